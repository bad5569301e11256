"""Launch engines: how ``hvd-scale run`` and ``engines.run`` start the workers (Horovod's, or
torch.distributed's under torchrun).

An engine runs N workers of an unchanged training command, or of a Python function, with the
environment hvd_scale hands to workers (``HVD_SCALE_POLICY``, ``HVD_SCALE_LOG_DIR`` and
``CPU_ENV_DEFAULTS`` or ``GPU_ENV_DEFAULTS``, all in ``Job.env``), and returns the command's exit status or the function's
per-rank results. The shared half below (``run``, ``run_command``) builds the ``Job`` and calls
only the four hooks of ``Engine``; it knows nothing else of horovodrun, Ray or Spark:

    engine.start(job)               bring up what the workers need (a Ray cluster, a SparkSession)
    engine.run(fn, args, job)       fn(*args) on every worker; the results in rank order
    engine.run_command(cmd, job)    the command on every worker; its exit status
    engine.shutdown()               undo start; always called, after a failure too

    from hvd_scale.launch import engines
    results = engines.run(train, args=(cfg,), np=2, engine="ray", policy="adascale")
    code = engines.run_command(["python", "train.py"], np=2, engine="spark", master="local[2]")

Four engines: ``horovodrun`` (the command under horovodrun, as ``hvd-scale run`` always did),
``ray`` (``horovod.ray.RayExecutor``: on the cluster at ``address``, else on a local one the engine
starts and stops; elastic with ``min_np``/``max_np``), ``spark`` (``horovod.spark.run`` on a
SparkSession, ``local[N]`` unless ``master`` says otherwise), and ``torchrun`` for
torch.distributed (DDP) scripts, without Horovod (``TorchrunEngine``: ``--nproc-per-node N``, one
node on 127.0.0.1 by default, several through a c10d rendezvous, elastic as ``--nnodes MIN:MAX``;
a torchrun command line given as the command runs as it is). Ray and Spark run a command through
``command_worker``: each worker starts it as a child process with its own environment (where
horovod.ray and horovod.spark put the Gloo rendezvous: ``HOROVOD_RANK``, ``HOROVOD_SIZE``,
``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``, ``HOROVOD_GLOO_IFACE``, ...) plus ``Job.env``, and
returns its exit code and output, which ``run_command`` prints tagged by rank the way horovodrun
does (``[0]<stdout>:...``), once the job is over. Ray, pyspark and horovod.ray/spark are imported
only inside their engines. SIGINT, SIGTERM or SIGHUP to the driver during ``run_command`` stops
the whole job (``STOP_TIMEOUT_S``, then SIGKILL) and raises ``JobStopped``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from hvd_scale.launch.jobs import (CPU_ENV_DEFAULTS, GPU_ENV_DEFAULTS,  # noqa: F401
                                   ELASTIC_MAX_RESTARTS, LOCAL_ADDR, find_horovodrun, find_torchrun,
                                   horovodrun_command, is_torchrun_command, start_np,
                                   torchrun_command)
from hvd_scale.adapters.log import check_every
from hvd_scale.estimate import SAMPLES, SAMPLES_ENV
from hvd_scale.metrics import LOG_DIR_ENV, LOG_EVERY_ENV
from hvd_scale.spec import POLICY_ENV, parse_spec

# Device files of NVIDIA's and AMD's (ROCm) drivers: there without importing a framework.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")


def driver_has_gpu() -> bool:
    """This machine has a GPU driver's device file (the workers are taken to be alike)."""
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)

SETUP_HINT = "run `make setup` (or `bash launch/setup_env.sh`) in the hvd_scale repository"
# pyproject.toml's extras, where the tested versions are pinned.
INSTALL_HINTS = {
    "ray": "pip install 'hvd-scale[ray]'",
    "spark": "pip install 'hvd-scale[spark]' (and Java 17)",
    "torchrun": "pip install 'hvd-scale[torch]' (torchrun comes with torch)",
}
# The optional modules a command may need, by the pyproject.toml extra that installs each
# (tests/test_install.py checks the names against pyproject.toml).
EXTRA_OF_MODULE = {
    "matplotlib": "plot", "torch": "torch", "tensorflow": "tensorflow", "keras": "keras",
    "mpi4py": "mpi", "ray": "ray", "pyspark": "spark", "pyarrow": "spark", "sacrebleu": "bleu",
    "tensorboard": "metrics", "tqdm": "metrics", "lightning": "lightning",
    "accelerate": "accelerate",
}
# What `pip install hvd-scale` installs (pyproject.toml's dependencies), by module.
REQUIRED_MODULES = ("numpy", "tensorboardX", "filelock", "packaging", "psutil")


def install_hint(module: str | None) -> str:
    """What to install for a missing module: its extra, or hvd-scale's own requirements, or
    Horovod (``hvd-scale build-horovod``)."""
    top = (module or "").split(".")[0]
    if top in EXTRA_OF_MODULE:
        return f"pip install 'hvd-scale[{EXTRA_OF_MODULE[top]}]'"
    if top in REQUIRED_MODULES:
        return f"a requirement of hvd-scale: pip install {top} (or reinstall hvd-scale)"
    if top == "horovod":
        return "hvd-scale build-horovod builds and installs it"
    return f"pip install {top}" if top else "install what the message names"


def missing_module(e: ImportError) -> str:
    """One line for an ImportError of a module not installed: which, and what to install."""
    name = e.name or str(e)
    return f"{name.split('.')[0]} is not installed: {install_hint(e.name)}"
# A local Ray cluster's object store: Ray's default is 30% of the memory, far more than per-rank
# results (or a command's output) need; 256 MiB keeps a small machine's memory for the workers.
RAY_OBJECT_STORE_BYTES = 256 * 1024 ** 2
# Workers of a fixed-size job when np is not given.
DEFAULT_NP = 2
# Seconds for the workers to start and meet (Ray: Gloo rendezvous; Spark: tasks registering).
START_TIMEOUT_S = 120
# A stop signal to the driver (SIGINT, SIGTERM, SIGHUP) goes on to the whole job, which then has
# STOP_TIMEOUT_S to exit (time for a rank to save a checkpoint, well inside the 30 s that
# Kubernetes and Slurm wait) before what is left is killed; the driver exits with 128 + signum.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_TIMEOUT_S = 10
KILL_WAIT_S = 2  # for SIGKILLed processes to be gone
# Set in the environment of each rank that command_worker starts, so that a stopped Ray or Spark
# job can pass the signal to its ranks among the cluster's own processes.
COMMAND_RANK_ENV = "HVD_SCALE_COMMAND_RANK"
# A command's first word that stands for "this Python": run as the interpreter that runs the
# engine (the driver's for horovodrun, each worker's for Ray and Spark), not the first one on
# PATH, which outside an activated venv lacked torch and Horovod on every rank (#48).
BARE_PYTHONS = frozenset({"python", "python3"})


def resolve_python(command: Sequence[Any]) -> list[str]:
    """The command with a bare ``python``/``python3`` first word replaced by sys.executable."""
    command = [str(c) for c in command]
    if command and command[0] in BARE_PYTHONS:
        command[0] = sys.executable
    return command


class JobStopped(KeyboardInterrupt):
    """The driver got a stop signal and stopped the job; ``exit_code`` is 128 + signum.
    A KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


class EngineUnavailable(RuntimeError):
    """The engine's software is missing here; the message says what to install."""


class JobNotStarted(RuntimeError):
    """The job failed before any worker started (the engine's start); its cause is chained."""


@dataclasses.dataclass(frozen=True)
class Job:
    """What the shared half hands every hook: how many workers and what they get.

    np: workers of a fixed-size job. min_np/max_np: an elastic job (min_np workers at least, up to
    max_np; np, when set, is where horovodrun starts it). env: the variables every worker (and a
    command's process) gets on top of its own environment. cwd: where a command runs.
    """

    np: int | None
    env: Mapping[str, str]
    min_np: int | None = None
    max_np: int | None = None
    cwd: str = dataclasses.field(default_factory=os.getcwd)

    @property
    def elastic(self) -> bool:
        return self.min_np is not None or self.max_np is not None


@runtime_checkable
class Engine(Protocol):
    """The hooks a launch engine implements; ``run`` and ``run_command`` call nothing else."""

    name: str

    def start(self, job: Job) -> None:
        """Bring up what the workers need (connect to or start a cluster, a SparkSession).

        Raises EngineUnavailable when the engine's software is missing, ValueError when the job
        asks for something the engine cannot do (e.g. an elastic job on Spark)."""

    def run(self, fn: Callable[..., Any], args: Sequence[Any], job: Job) -> list[Any]:
        """Call fn(*args) once on every worker, with job.env in the worker's environment;
        return the results in rank order."""

    def run_command(self, command: Sequence[str], job: Job) -> int:
        """Run the command once on every worker, with job.env on top of the worker's environment
        and the Horovod rendezvous variables; return its exit status (0 when every rank
        succeeded). Engines without a launcher of their own return
        ``command_via_workers(self, command, job)``."""

    def shutdown(self) -> None:
        """Release what start brought up; called once after start, also when start or the job
        failed (so it must cope with a start that stopped half-way), and once more when a stop
        signal cuts it short."""


# ----------------------------------------------------------------------------------------------
# The shared half: calls only the hooks above.

def worker_env(policy: str | None = None, log_dir: str | os.PathLike | None = None,
               environ: Mapping[str, str] | None = None, gpu: bool | None = None,
               log_every: int | None = None, samples: str | None = None) -> dict[str, str]:
    """The variables hvd_scale hands every worker: CPU_ENV_DEFAULTS, or GPU_ENV_DEFAULTS where the
    driver has a GPU (``gpu``; default ``driver_has_gpu()``), each unless the driver's environment
    sets it; the policy spec, the absolute log directory (created here), and what the
    statistics read (``samples``: ``hvd_scale.estimate.SAMPLES``)."""
    environ = os.environ if environ is None else environ
    defaults = GPU_ENV_DEFAULTS if (driver_has_gpu() if gpu is None else gpu) else CPU_ENV_DEFAULTS
    env = {key: environ.get(key, value) for key, value in defaults.items()}
    if policy is not None:
        parse_spec(policy)  # a bad spec is a ValueError before anything starts
        env[POLICY_ENV] = policy
    if log_dir is not None:
        env[LOG_DIR_ENV] = os.path.abspath(os.fspath(log_dir))
        os.makedirs(env[LOG_DIR_ENV], exist_ok=True)
    if check_every(log_every, "log_every") is not None:
        env[LOG_EVERY_ENV] = str(log_every)
    if samples is not None:
        if samples not in SAMPLES:
            raise ValueError(f"samples must be one of {SAMPLES}, got {samples!r}")
        env[SAMPLES_ENV] = samples
    return env


def make_job(np: int | None = None, policy: str | None = None, log_dir=None,
             min_np: int | None = None, max_np: int | None = None,
             log_every: int | None = None, samples: str | None = None) -> Job:
    """A Job after checking the numbers; ValueError names what is wrong."""
    for name, value in (("np", np), ("min_np", min_np), ("max_np", max_np)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max_np is not None and min_np is None:
        raise ValueError(f"max_np={max_np} needs min_np (an elastic job's lower bound)")
    if min_np is not None and max_np is not None and min_np > max_np:
        raise ValueError(f"min_np must be <= max_np, got min_np={min_np}, max_np={max_np}")
    if np is None and min_np is None:
        np = DEFAULT_NP
    return Job(np=np, env=worker_env(policy, log_dir, log_every=log_every, samples=samples),
               min_np=min_np,
               max_np=max_np)


def make_engine(engine: str | Engine, **options: Any) -> Engine:
    """An engine by name (ENGINES) with its options, or an Engine instance as it is."""
    if isinstance(engine, str):
        try:
            factory = ENGINES[engine]
        except KeyError:
            raise ValueError(f"unknown engine {engine!r}; choose one of "
                             f"{', '.join(sorted(ENGINES))}") from None
        return factory(**options)
    if options:
        raise TypeError(f"engine options {sorted(options)} go with an engine name, "
                        f"not with an Engine instance ({type(engine).__name__})")
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a name or implement Engine (start, run, run_command, "
                        f"shutdown), got {type(engine).__name__}")
    return engine


def run(fn: Callable[..., Any], args: Sequence[Any] = (), np: int | None = None,
        engine: str | Engine = "ray", policy: str | None = None, log_dir=None, *,
        min_np: int | None = None, max_np: int | None = None, **engine_options: Any) -> list[Any]:
    """Run fn(*args) on np Horovod workers (default 2) of `engine`; the per-rank results.

    policy and log_dir reach every worker as HVD_SCALE_POLICY and HVD_SCALE_LOG_DIR, which the
    adapters read. min_np/max_np make the job elastic (Ray: RayExecutor's min/max workers).
    engine_options go to the engine: ray (address, num_cpus, cpus_per_worker, nics, timeout_s),
    spark (master, start_timeout, nics, verbose), horovodrun (hosts, controller).
    """
    job = make_job(np, policy, log_dir, min_np, max_np)
    eng = make_engine(engine, **engine_options)
    try:
        eng.start(job)
        return eng.run(fn, tuple(args), job)
    finally:
        eng.shutdown()


def run_command(command: Sequence[str], np: int | None = None, engine: str | Engine = "horovodrun",
                policy: str | None = None, log_dir=None, *, min_np: int | None = None,
                max_np: int | None = None, log_every: int | None = None,
                samples: str | None = None, **engine_options: Any) -> int:
    """Run an unchanged training command on np workers of `engine`; its exit status."""
    if not command:
        raise ValueError("give the command to run")
    job = make_job(np, policy, log_dir, min_np, max_np, log_every, samples)
    eng = make_engine(engine, **engine_options)
    try:
        earlier = {p.pid for p in _below([_this_process()])}  # not the job's: never stopped
    except ImportError as e:  # psutil: a requirement, missing from a broken install
        raise EngineUnavailable(missing_module(e)) from None
    with _StopOnSignals() as stop:
        try:
            try:
                try:
                    eng.start(job)
                except (EngineUnavailable, ValueError, KeyboardInterrupt):
                    raise
                except ImportError as e:
                    raise EngineUnavailable(f"the {eng.name} engine needs {missing_module(e)}") \
                        from None
                except Exception as e:  # nothing of the job started: not "the job failed"
                    raise JobNotStarted(f"{type(e).__name__}: {e}") from e
                stop.arm()  # again: start may set handlers of its own (ray.init's SIGTERM exits)
                return eng.run_command(list(command), job)
            finally:
                stop.check()  # a stop signal that a library's own handler took stops the job too
                if not stop.stopping:
                    eng.shutdown()
        except KeyboardInterrupt:  # JobStopped, or the KeyboardInterrupt a library made of it
            if not stop.stopping:
                raise
            job_procs = [p for p in _below([_this_process()]) if p.pid not in earlier]
            _stop_engine(eng, stop.signum, job_procs)
            raise JobStopped(stop.signum) from None


def command_worker(command: Sequence[str], env: Mapping[str, str], cwd: str | None) -> dict:
    """Runs in a worker: the command as a child process with the worker's environment (the
    engine's Horovod rendezvous variables) plus `env`; its rank, exit code and output."""
    child_env = dict(os.environ)
    child_env.update(env)
    child_env[COMMAND_RANK_ENV] = "1"
    proc = subprocess.run(resolve_python(command), env=child_env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, errors="replace",
                          cwd=cwd if cwd and os.path.isdir(cwd) else None,
                          preexec_fn=_rank_setup())
    return {"rank": int(os.environ.get("HOROVOD_RANK", "-1")), "returncode": proc.returncode,
            "stdout": proc.stdout, "stderr": proc.stderr}


def _rank_setup() -> Callable[[], None]:
    """A preexec_fn for the child: the stop signals unblocked (Ray's processes block SIGINT, and
    a signal mask survives exec, so the rank would miss the driver's SIGINT) and, on Linux, the
    child killed when its worker dies, so a worker that Ray or Spark kills leaves no training
    process behind."""
    die_with_parent = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        pr_set_pdeathsig = 1
        die_with_parent = lambda: prctl(pr_set_pdeathsig, signal.SIGKILL)  # noqa: E731

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if die_with_parent is not None:
            die_with_parent()

    return setup


def command_via_workers(engine: Engine, command: Sequence[str], job: Job) -> int:
    """run_command for an engine that runs functions only: command_worker on every worker, each
    rank's output printed with horovodrun's tags, and the first non-zero exit code (else 0)."""
    results = engine.run(command_worker, (list(command), dict(job.env), job.cwd), job)
    return report(results)


def report(results: Sequence[Mapping[str, Any]], out=None, err=None) -> int:
    """Print command_worker results as horovodrun (Gloo) tags its ranks' lines:
    ``[RANK]<stdout>:LINE`` to stdout, ``[RANK]<stderr>:LINE`` to stderr. The exit status: the
    first non-zero exit code in rank order, else 0."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    status = 0
    for r in sorted(results, key=lambda r: r["rank"]):
        for stream, text in ((out, r["stdout"]), (err, r["stderr"])):
            tag = f"[{r['rank']}]<{'stdout' if stream is out else 'stderr'}>:"
            for line in text.splitlines():
                stream.write(tag + line + "\n")
        if r["returncode"] != 0 and status == 0:
            status = r["returncode"] if r["returncode"] > 0 else 128 - r["returncode"]
    out.flush()
    err.flush()
    return status


def _call_with_env(fn: Callable[..., Any], args: Sequence[Any], env: Mapping[str, str]) -> Any:
    """Runs in a worker: job.env into its environment, then fn(*args)."""
    os.environ.update(env)
    return fn(*args)


# ----------------------------------------------------------------------------------------------
# Stopping a job on SIGINT, SIGTERM or SIGHUP to the driver. Left to their default actions these
# end the driver at once, and horovodrun (or mpirun, re-parented to PID 1) and the ranks train on.
# Processes are found with psutil, a requirement of hvd-scale (pyproject.toml): a DDP environment
# has no Horovod to bring it.

class _StopOnSignals:
    """While a job runs, the first stop signal raises JobStopped in the driver's main thread
    and is recorded (stopping, signum), also for when a library turns the exception into another
    KeyboardInterrupt. Later signals are ignored, so that they cannot cut the stop short (it is
    bounded already). A library may replace the handlers while the job runs (horovod.spark's
    launch_gloo does, and its handler ends the job as a failure): Python also writes the number
    of every signal it handles to a wakeup fd, which check() reads. The previous handlers and
    wakeup fd come back on exit. Python sets handlers only in the main thread: elsewhere this
    does nothing."""

    def __init__(self):
        self.signum: int | None = None
        self.stopping = False
        self._saved: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._wakeup = -1

    def _handler(self, signum, frame):
        if not self.stopping:
            self.stopping, self.signum = True, signum
            raise JobStopped(signum)

    def arm(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._saved.setdefault(signum, signal.signal(signum, self._handler))

    def check(self) -> None:
        """Raise JobStopped for a stop signal that reached another handler."""
        if self.stopping or self._pipe is None:
            return
        try:
            received = os.read(self._pipe[0], 4096)
        except BlockingIOError:  # nothing came
            return
        for signum in received:
            if signum in STOP_SIGNALS:
                self.stopping, self.signum = True, signum
                raise JobStopped(signum)

    def __enter__(self) -> "_StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            self._pipe = os.pipe()
            for fd in self._pipe:
                os.set_blocking(fd, False)
            self._wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        self.arm()
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._wakeup)
            for fd in self._pipe:
                os.close(fd)


def _this_process():
    import psutil

    return psutil.Process()


def _below(procs) -> list:
    """The descendants of procs (psutil.Process objects)."""
    import psutil

    found = []
    for p in procs:
        try:
            found += p.children(recursive=True)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def _running(p) -> bool:
    import psutil

    try:  # a zombie has exited: only its parent's wait is missing
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_processes(signum: int, procs, groups: Sequence[int] = ()) -> None:
    """Send signum to procs (psutil.Process objects), their descendants and the process groups,
    give them STOP_TIMEOUT_S to exit, then SIGKILL what is left. Descendants are looked up again
    while waiting, so a process started meanwhile gets the signal too, and one re-parented to
    PID 1 when its parent exits (mpirun after horovodrun's shell) is still known."""
    import psutil

    known = {p.pid: p for p in [*procs, *_below(procs)]}
    for sig, wait_s in ((signum, STOP_TIMEOUT_S), (signal.SIGKILL, KILL_WAIT_S)):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        sent: set[int] = set()
        deadline = time.monotonic() + wait_s
        while True:
            alive = [p for p in known.values() if _running(p)]
            for p in alive:
                if p.pid not in sent:
                    sent.add(p.pid)
                    try:
                        p.send_signal(sig)
                    except psutil.Error:
                        pass
            if not alive or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
            known.update((p.pid, p) for p in _below(alive) if p.pid not in known)
        if not alive:
            return


def _stop_engine(engine: Engine, signum: int, job_procs: list) -> None:
    """The stop of a job whose engine runs its ranks in a cluster (Ray, Spark; horovodrun's
    run_command has stopped its own processes already): signum to the ranks command_worker
    started, then the engine's shutdown, each bounded by STOP_TIMEOUT_S (a shutdown that hangs
    gets the job's processes below the driver killed under it); then the signal, the bounded
    wait and SIGKILL for whatever the shutdown left (a local Ray cluster, Spark's JVM)."""
    def is_rank(p) -> bool:
        try:
            return p.environ().get(COMMAND_RANK_ENV) == "1"
        except Exception:  # gone, or not readable
            return False

    stop_processes(signum, [p for p in job_procs if is_rank(p)])
    watchdog = threading.Timer(STOP_TIMEOUT_S, stop_processes,
                               (signal.SIGKILL, [p for p in job_procs if _running(p)]))
    watchdog.daemon = True
    watchdog.start()
    try:
        engine.shutdown()
    finally:
        watchdog.cancel()
        stop_processes(signum, [p for p in job_procs if _running(p)])


def run_stoppable(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """subprocess.call(cmd, env=env), the child in a session of its own, so that a terminal's
    Ctrl-C reaches the driver alone, which stops the child's whole tree on JobStopped (its group
    and every descendant: horovodrun, mpirun, Gloo's per-rank sessions, the ranks). A SIGINT
    reaches them as SIGTERM, as horovodrun's own Ctrl-C stops its ranks: a rank of a Python
    script would print a KeyboardInterrupt traceback each (save on SIGTERM to save on Ctrl-C)."""
    import psutil

    proc = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
    try:
        return proc.wait()
    except BaseException as e:  # JobStopped; anything else must not leave the job either
        signum = e.signum if isinstance(e, JobStopped) and e.signum != signal.SIGINT \
            else signal.SIGTERM
        try:
            procs = [psutil.Process(proc.pid)]  # not reaped yet (a zombie at worst)
        except psutil.NoSuchProcess:  # reaped just as the signal came
            procs = []
        stop_processes(signum, procs, groups=[proc.pid])
        proc.poll()  # reap it
        raise


# ----------------------------------------------------------------------------------------------
# horovodrun

HOSTNAME_CHECK_TIMEOUT_S = 10
# horovodrun's options that name the NICs (Horovod 0.28.1; the second is an alias).
NIC_OPTIONS = ("--network-interfaces", "--network-interface")
# A host discovery script run once at the start, to see where an elastic job would begin.
DISCOVERY_TIMEOUT_S = 10


def _option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the first of ``names`` in args (``--opt VALUE`` or ``--opt=VALUE``)."""
    for i, a in enumerate(args):
        option, eq, value = a.partition("=")
        if option in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def elastic_hosts(hosts: str | None, extra_args: Sequence[str],
                  cwd: str | None = None) -> list[str] | None:
    """The hosts an elastic horovodrun job starts on, as far as they are known now: a
    --host-discovery-script's output (run once here, in cwd, as horovodrun runs it: a shell
    command), a --hostfile's, else -H's (default localhost). None: the script failed."""
    script = _option_value(extra_args, ("--host-discovery-script",))
    hostfile = _option_value(extra_args, ("--hostfile", "-hostfile"))
    if script is not None:
        try:
            out = subprocess.run(script, shell=True, cwd=cwd, capture_output=True, text=True,
                                 timeout=DISCOVERY_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0:
            return None
        lines = out.stdout.splitlines()
    elif hostfile is not None:
        try:
            with open(os.path.join(cwd or "", hostfile)) as f:
                lines = [line.split()[0] for line in f if line.split()
                         and not line.lstrip().startswith("#")]
        except OSError:
            return None
    else:
        lines = (hosts or "localhost").split(",")
    return [line.strip().rsplit(":", 1)[0] for line in lines if line.strip()]


def is_local_host(host: str) -> bool:
    """The host is this machine: every address it resolves to is a loopback or one of this
    machine's own (psutil.net_if_addrs)."""
    import ipaddress
    import socket

    import psutil

    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    own = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in own
                               for a in found)


def one_host_nics(job: Job, hosts: str | None, extra_args: Sequence[str], out=None) -> list[str]:
    """What an elastic horovodrun job on this host alone needs: ``--network-interfaces lo``.
    Without a NIC named, Horovod 0.28.1's elastic driver waits for two hosts to find the
    interfaces they share (``_get_min_start_hosts``), silently, for ever on one host. Where the
    job's hosts are not all this one and fewer than two, a warning says what to add."""
    if not job.elastic or _option_value(extra_args, NIC_OPTIONS) is not None:
        return []
    names = elastic_hosts(hosts, extra_args, job.cwd)
    if names and all(is_local_host(h) for h in names) and _has_interface("lo"):
        return ["--network-interfaces", "lo"]
    if names is not None and len(set(names)) < 2:
        print(f"hvd-scale run: warning: an elastic Horovod job without --network-interfaces waits "
              f"for two hosts to find the network interfaces they share, and starts with "
              f"{', '.join(names) or 'no host'} found now: name the interface the hosts share "
              f"(--network-interfaces eth0; lo for this host alone)", file=out or sys.stderr)
    return []


def remote_hostnames(hosts: str | None, extra_args: Sequence[str]) -> dict[str, str]:
    """{host: the hostname it reports} for the hosts of a multi-host -H, over ssh with the port
    and key horovodrun is given (-p/--ssh-port, -i/--ssh-identity-file). Unreachable: left out
    (horovodrun reports those itself)."""
    names = [h.rsplit(":", 1)[0] for h in (hosts or "").split(",") if h]
    if len(names) < 2:
        return {}
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={HOSTNAME_CHECK_TIMEOUT_S}"]
    args = list(extra_args)
    for flags, ssh_flag in ((("-p", "--ssh-port"), "-p"), (("-i", "--ssh-identity-file"), "-i")):
        for i, a in enumerate(args[:-1]):
            if a in flags:
                ssh += [ssh_flag, args[i + 1]]
    found = {}
    for host in names:
        try:
            out = subprocess.run(ssh + [host, "hostname"], capture_output=True, text=True,
                                 timeout=HOSTNAME_CHECK_TIMEOUT_S + 5, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            found[host] = out.stdout.strip()
    return found


def warn_shared_hostnames(hosts: str | None, extra_args: Sequence[str], out=None) -> bool:
    """Warn when two hosts of -H report the same hostname: Horovod 0.28.1 resolves
    gethostname() in one Gloo set-up path, so such hosts fail with a Gloo connection error to
    127.0.0.1 that names neither host. Returns whether it warned."""
    seen: dict[str, list[str]] = {}
    for host, name in remote_hostnames(hosts, extra_args).items():
        seen.setdefault(name, []).append(host)
    shared = {name: hs for name, hs in seen.items() if len(hs) > 1}
    for name, hs in shared.items():
        print(f"hvd-scale run: warning: hosts {', '.join(hs)} all report the hostname {name!r}; "
              "Horovod 0.28.1 resolves the hostname in one Gloo path and such a job fails with "
              "'Connection refused' on 127.0.0.1: give each host its own hostname",
              file=out or sys.stderr)
    return bool(shared)


class HorovodrunEngine:
    """The command under ``horovodrun`` (a function under ``horovod.run``), which hands the
    environment to every worker (Gloo and MPI). hosts: ``-H`` (default localhost:N); controller:
    "gloo", "mpi" or None (horovodrun's choice); extra_args: any other horovodrun options. An
    elastic job whose hosts are this one alone gets ``--network-interfaces lo`` unless a NIC is
    named (``one_host_nics``), as the torchrun engine puts a one-node job's Gloo on the loopback."""

    name = "horovodrun"

    def __init__(self, hosts: str | None = None, controller: str | None = None,
                 extra_args: Sequence[str] = (), executable: str | None = None):
        if controller not in (None, "gloo", "mpi"):
            raise ValueError(f"controller must be 'gloo', 'mpi' or None, got {controller!r}")
        self.hosts, self.controller = hosts, controller
        self.extra_args = list(extra_args)
        self.executable = executable
        self._added_args: list[str] = []  # what the job needs besides (one_host_nics)

    def start(self, job: Job) -> None:
        self.executable = self.executable or find_horovodrun()
        if self.executable is None:
            raise EngineUnavailable(f"horovodrun not found: {SETUP_HINT}")
        self._added_args = one_host_nics(job, self.hosts, self.extra_args)

    def command_line(self, command: Sequence[str], job: Job) -> list[str]:
        return horovodrun_command(resolve_python(command), job.np, hosts=self.hosts,
                                  controller=self.controller,
                                  extra_args=self.extra_args + self._added_args,
                                  min_np=job.min_np, max_np=job.max_np,
                                  executable=self.executable)

    def run_command(self, command: Sequence[str], job: Job) -> int:
        env = dict(os.environ)
        env.update(job.env)
        warn_shared_hostnames(self.hosts, self.extra_args)
        return run_stoppable(self.command_line(command, job), env=env)

    def run(self, fn: Callable[..., Any], args: Sequence[Any], job: Job) -> list[Any]:
        import horovod.runner

        from .horovodrun import check_torch_first

        check_torch_first()  # as hvd-scale-horovodrun: the build check, seconds sooner
        saved = dict(os.environ)
        os.environ.update(job.env)  # horovod.run hands os.environ to the workers
        try:
            return horovod.runner.run(
                fn, args=tuple(args), num_proc=start_np(job.np, job.min_np),
                min_num_proc=job.min_np, max_num_proc=job.max_np,
                hosts=self.hosts or f"localhost:{job.np or job.max_np or job.min_np}",
                use_gloo=self.controller == "gloo" or None,
                use_mpi=self.controller == "mpi" or None)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def shutdown(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# Ray

class RayEngine:
    """Workers as Ray actors through ``horovod.ray.RayExecutor``.

    address: an existing cluster to join (``ray.init(address=...)``; it stays up afterwards).
    Without one, a process already connected to Ray (``ray.init`` called) keeps and uses that
    connection; otherwise the engine starts a local cluster (num_cpus: default the larger of the
    cores and the workers) whose files live in a temporary directory removed at shutdown, with
    Ray's auth token and usage reporting off (RAY_AUTH_MODE=disabled, RAY_USAGE_STATS_ENABLED=0,
    unless set). Elastic jobs (min_np/max_np) use RayExecutor's min_workers/max_workers; on one
    machine Horovod needs the NIC named, so a local cluster gets nics={"lo"} unless nics says
    otherwise (on a real cluster, name the NIC the hosts share).
    """

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 cpus_per_worker: int = 1, nics: set[str] | None = None,
                 timeout_s: int = START_TIMEOUT_S,
                 object_store_memory: int | None = RAY_OBJECT_STORE_BYTES):
        self.address, self.num_cpus = address, num_cpus
        self.cpus_per_worker, self.nics, self.timeout_s = cpus_per_worker, nics, timeout_s
        self.object_store_memory = object_store_memory
        self._executor = None
        self._temp_dir: str | None = None
        self._connected = False

    def start(self, job: Job) -> None:
        try:
            import ray
            from horovod.ray import RayExecutor
        except ImportError as e:
            raise EngineUnavailable(f"the ray engine needs ray and horovod.ray ({e}): "
                                    f"{INSTALL_HINTS['ray']}") from None
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if self.address is None and ray.is_initialized():
            nics = self.nics  # the caller's own Ray connection: used as it is, left up
        elif self.address is not None:
            ray.init(address=self.address, log_to_driver=True)
            self._connected = True
            nics = self.nics
        else:
            workers = max(n for n in (job.np, job.min_np, job.max_np, 1) if n is not None)
            # Short: Ray's Unix sockets live below it (a path of at most 107 bytes).
            self._temp_dir = tempfile.mkdtemp(prefix="hvdray-")
            ray.init(num_cpus=self.num_cpus or max(os.cpu_count() or 1,
                                                   workers * self.cpus_per_worker),
                     include_dashboard=False, object_store_memory=self.object_store_memory,
                     _temp_dir=self._temp_dir, log_to_driver=True)
            self._connected = True
            nics = self.nics or {"lo"}
        settings = RayExecutor.create_settings(timeout_s=self.timeout_s, nics=nics)
        if job.elastic:
            executor = RayExecutor(settings, min_workers=job.min_np, max_workers=job.max_np,
                                   cpus_per_worker=self.cpus_per_worker, use_gpu=False)
        else:
            executor = RayExecutor(settings, num_workers=job.np,
                                   cpus_per_worker=self.cpus_per_worker, use_gpu=False)
        executor.start(extra_env_vars=dict(job.env))
        self._executor = executor

    def run(self, fn: Callable[..., Any], args: Sequence[Any], job: Job) -> list[Any]:
        return self._executor.run(_call_with_env, args=[fn, tuple(args), dict(job.env)])

    def run_command(self, command: Sequence[str], job: Job) -> int:
        return command_via_workers(self, command, job)

    def shutdown(self) -> None:
        try:
            if self._executor is not None:
                try:
                    self._executor.shutdown()
                except Exception:  # an elastic driver that never finished; ray.shutdown cleans up
                    pass
                self._executor = None
        finally:
            if self._connected:
                import ray

                ray.shutdown()
                self._connected = False
            if self._temp_dir is not None:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
                self._temp_dir = None


# ----------------------------------------------------------------------------------------------
# Spark

class SparkEngine:
    """One Spark task per worker through ``horovod.spark.run`` (Gloo).

    master: the Spark master (default ``local[N]``). An active SparkSession is used as it is when
    master is not given, and left running; otherwise the engine builds one and stops it at
    shutdown. A local master binds 127.0.0.1, without the web UI, with its scratch files
    (spark.local.dir, java.io.tmpdir) in a temporary directory removed at shutdown and no JVM
    performance-data files (-XX:-UsePerfData). conf: more Spark settings, applied last.
    """

    name = "spark"

    def __init__(self, master: str | None = None, start_timeout: int = START_TIMEOUT_S,
                 nics: set[str] | None = None, verbose: int = 1,
                 conf: Mapping[str, str] | None = None):
        self.master, self.start_timeout = master, start_timeout
        self.nics, self.verbose = nics, verbose
        self.conf = dict(conf or {})
        self._session = None
        self._owns_session = False
        self._temp_dir: str | None = None

    def start(self, job: Job) -> None:
        if job.elastic:
            raise ValueError("the spark engine runs fixed-size jobs: give np, not min_np/max_np "
                             "(elastic jobs: the ray or horovodrun engine)")
        try:
            from pyspark.sql import SparkSession
            import horovod.spark  # noqa: F401
        except ImportError as e:
            raise EngineUnavailable(f"the spark engine needs pyspark and horovod.spark ({e}): "
                                    f"{INSTALL_HINTS['spark']}") from None
        active = SparkSession.getActiveSession()
        if self.master is None and active is not None:
            self._session = active
            return
        master = self.master or f"local[{job.np}]"
        builder = SparkSession.builder.master(master).appName("hvd-scale")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        if master.startswith("local"):
            # The launcher JVM (spark-class) would write /tmp/hsperfdata_$USER otherwise.
            os.environ.setdefault("SPARK_LAUNCHER_OPTS", "-XX:-UsePerfData")
            self._temp_dir = tempfile.mkdtemp(prefix="hvdspark-")
            conf = {
                "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.local.dir": self._temp_dir,
                "spark.sql.warehouse.dir": os.path.join(self._temp_dir, "warehouse"),
                "spark.driver.extraJavaOptions":
                    f"-Djava.io.tmpdir={self._temp_dir} -XX:-UsePerfData",
            }
        else:
            conf = {}
        conf.update(self.conf)
        for key, value in conf.items():
            builder = builder.config(key, value)
        self._session = builder.getOrCreate()
        self._owns_session = True

    def run(self, fn: Callable[..., Any], args: Sequence[Any], job: Job) -> list[Any]:
        import horovod.spark

        return horovod.spark.run(_call_with_env, args=(fn, tuple(args), dict(job.env)),
                                 num_proc=job.np, use_gloo=True, env=dict(job.env),
                                 start_timeout=self.start_timeout, nics=self.nics,
                                 verbose=self.verbose)

    def run_command(self, command: Sequence[str], job: Job) -> int:
        return command_via_workers(self, command, job)

    def shutdown(self) -> None:
        try:
            if self._owns_session and self._session is not None:
                self._session.stop()
        finally:
            self._session, self._owns_session = None, False
            if self._temp_dir is not None:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
                self._temp_dir = None


# ----------------------------------------------------------------------------------------------
# torchrun

class TorchrunEngine:
    """The command under ``torchrun`` (torch.distributed's elastic launcher), for scripts that
    wrap a ``DistributedDataParallel`` model in ``hvd_scale.adapters.torch.ddp``'s optimizer. No
    Horovod is needed: torchrun sets each rank's RANK, WORLD_SIZE, MASTER_ADDR/PORT, and the
    workers get Job.env (HVD_SCALE_POLICY, HVD_SCALE_LOG_DIR, the CPU/GPU defaults) as under the
    Horovod engines.

    job.np is the processes per node (torchrun's ``--nproc-per-node``); an elastic job's
    min_np/max_np count nodes (``--nnodes MIN:MAX``, each node running np processes). One node
    by default: ``--standalone`` on 127.0.0.1, Gloo on the loopback (GLOO_SOCKET_IFNAME=lo
    unless set). Several: run the same command on every node, with ``nnodes`` and the c10d
    ``rdzv_endpoint`` HOST:PORT (a node's address; ``node_rank`` too for torchrun's static
    rendezvous, the endpoint then being node 0's). ``max_restarts``: torchrun's (elastic default
    ``jobs.ELASTIC_MAX_RESTARTS``). extra_args: other torchrun options (``--rdzv-conf``,
    ``--tee``, ``--local-addr``...). A command that is a torchrun command line itself
    (``torchrun --nproc-per-node 2 train.py``) runs as given, with Job.env. Stop signals:
    ``run_stoppable`` (torchrun passes the signal on to its workers).
    """

    name = "torchrun"

    def __init__(self, nnodes: int | None = None, node_rank: int | None = None,
                 rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                 max_restarts: int | None = None, extra_args: Sequence[str] = (),
                 executable: Sequence[str] | str | None = None):
        self.nnodes, self.node_rank = nnodes, node_rank
        self.rdzv_endpoint, self.rdzv_id, self.max_restarts = rdzv_endpoint, rdzv_id, max_restarts
        self.extra_args = [str(a) for a in extra_args]
        self.executable = executable

    def start(self, job: Job) -> None:
        if job.elastic and job.max_np is None:
            raise ValueError("an elastic torchrun job needs max_np (torchrun's --nnodes MIN:MAX "
                             "counts nodes)")
        self.command_line(["python", "train.py"], job)  # ValueError: what torchrun cannot run
        try:
            import torch.distributed.run  # noqa: F401
        except ImportError as e:
            raise EngineUnavailable(f"the torchrun engine needs torch ({e}): "
                                    f"{INSTALL_HINTS['torchrun']}") from None
        self.executable = self.executable or find_torchrun()
        if self.executable is None:
            raise EngineUnavailable(f"torchrun not found: {INSTALL_HINTS['torchrun']}")

    @property
    def one_node(self) -> bool:
        return self.rdzv_endpoint is None and self.nnodes in (None, 1)

    def command_line(self, command: Sequence[str], job: Job) -> list[str]:
        command = [str(c) for c in command]
        if is_torchrun_command(command):  # the user's own torchrun line: as given
            if command[0] == "torchrun":  # a bare torchrun: this Python's, as a bare python
                command = list(self.executable or find_torchrun() or ["torchrun"]) + command[1:]
            return resolve_python(command)
        return torchrun_command(command, job.np, nnodes=self.nnodes,
                                min_nodes=job.min_np, max_nodes=job.max_np,
                                node_rank=self.node_rank, rdzv_endpoint=self.rdzv_endpoint,
                                rdzv_id=self.rdzv_id, max_restarts=self.max_restarts,
                                extra_args=self.extra_args, executable=self.executable)

    def environment(self, job: Job, environ: Mapping[str, str] | None = None,
                    command: Sequence[str] = ()) -> dict[str, str]:
        """The driver's environment with Job.env on top; a one-node job's Gloo on the loopback
        (not for a torchrun command line of the user's, which may name other nodes)."""
        env = dict(os.environ if environ is None else environ)
        env.update(job.env)
        if (self.one_node and not is_torchrun_command(command)
                and "GLOO_SOCKET_IFNAME" not in env and _has_interface("lo")):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        return env

    def run_command(self, command: Sequence[str], job: Job) -> int:
        return run_stoppable(self.command_line(command, job),
                             env=self.environment(job, command=command))

    def run(self, fn: Callable[..., Any], args: Sequence[Any], job: Job) -> list[Any]:
        """fn(*args) in each of this node's processes (torch's ``elastic_launch``, spawned: fn
        must be importable); this node's results in local-rank order (all of them on one node)."""
        import uuid

        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        endpoint, backend, configs = f"{LOCAL_ADDR}:0", "c10d", {}
        local_addr = LOCAL_ADDR if self.one_node else None
        if not self.one_node:
            endpoint = self.rdzv_endpoint
            if self.node_rank is not None:
                backend, configs = "static", {"rank": self.node_rank}
        nodes = (job.min_np, job.max_np) if job.elastic else (self.nnodes or 1,) * 2
        restarts = self.max_restarts if self.max_restarts is not None else \
            (ELASTIC_MAX_RESTARTS if job.elastic else 0)
        config = LaunchConfig(min_nodes=nodes[0], max_nodes=nodes[1], nproc_per_node=job.np or 1,
                              run_id=self.rdzv_id or (uuid.uuid4().hex if self.one_node else
                                                      "none"),
                              rdzv_backend=backend, rdzv_endpoint=endpoint,
                              rdzv_configs=configs, max_restarts=restarts,
                              local_addr=local_addr, start_method="spawn")
        env = self.environment(job, environ={})
        saved = dict(os.environ)
        os.environ.update(env)  # the spawned processes start from the driver's environment
        try:
            results = elastic_launch(config, _call_with_env)(fn, tuple(args), dict(job.env))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return [results[i] for i in sorted(results)]

    def shutdown(self) -> None:
        pass


def _has_interface(name: str) -> bool:
    import socket

    try:
        return any(n == name for _, n in socket.if_nameindex())
    except OSError:
        return False


ENGINES: dict[str, Callable[..., Engine]] = {
    "horovodrun": HorovodrunEngine,
    "ray": RayEngine,
    "spark": SparkEngine,
    "torchrun": TorchrunEngine,
}
