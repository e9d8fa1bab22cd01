"""Beyond one process tree, on real engines installed and started by the project's scripts (scripts/services/):
a team MLflow store on PostgreSQL (a sweep logs to it; its server and its database restarted mid-sweep) and sweeps as
real SLURM jobs on a single-node cluster (a job that raises, a job past its time limit, a cancelled job, the re-run,
a job pre-empted by a higher-priority partition and requeued).
Each skips with one line where its services cannot be installed or started (not root, no Debian packages)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY, free_port

pytestmark = pytest.mark.slow

SERVICES = REPO / "scripts" / "services"
STORE_ADDRESS = "127.0.0.2"


def _service(script: str, command: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SERVICES / script), command], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def services_env():
    """A scratch QEXP_SERVICES_DIR (world-traversable: PostgreSQL and MariaDB run as their own users) and free ports."""
    folder = tempfile.mkdtemp(prefix="qexp-services-")
    os.chmod(folder, 0o755)
    # the store listens on 127.0.0.2 and is named by it, as a compute node names the store's host (never 127.0.0.1,
    # which MLflow's Host-header guard lets through by default); store-host is an alias the cluster's DNS would give
    env = {**os.environ, "QEXP_SERVICES_DIR": folder, "QEXP_PG_PORT": str(free_port()),
           "QEXP_MLFLOW_PORT": str(free_port()), "QEXP_MLFLOW_HOST": STORE_ADDRESS,
           "QEXP_MLFLOW_ALLOWED_HOSTS": "store-host"}
    yield env
    for script in ("mlflow_server.sh", "postgres.sh", "slurm.sh"):
        _service(script, "stop", env)


@pytest.fixture(scope="module")
def team_store(services_env):
    """An MLflow server on PostgreSQL with served artifacts and logins: its URL. The tests (and the jobs they start,
    through the environment) log in as its admin, as a lab's own account would."""
    started = _service("mlflow_server.sh", "start", services_env)
    if started.returncode != 0:
        pytest.skip(f"no PostgreSQL-backed MLflow server here: {started.stderr.strip().splitlines()[-1]}")
    login = {"MLFLOW_TRACKING_USERNAME": "admin",
             "MLFLOW_TRACKING_PASSWORD": Path(services_env["QEXP_SERVICES_DIR"], "mlflow-admin-password").read_text()
             .strip()}
    services_env.update(login)
    saved = {k: os.environ.get(k) for k in login}
    os.environ.update(login)
    yield started.stdout.strip().splitlines()[-1]
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def slurm(services_env, team_store):
    """A single-node SLURM cluster: the environment its clients need (SLURM_CONF)."""
    started = _service("slurm.sh", "start", services_env)
    if started.returncode != 0:
        pytest.skip(f"no SLURM cluster here: {(started.stderr.strip().splitlines() or ['?'])[-1]}")
    conf = started.stdout.strip().splitlines()[-1].split("=", 1)[1]
    return {**services_env, "SLURM_CONF": conf}


def test_the_store_answers_to_its_hosts_names_and_refuses_others(team_store):
    """Clients name the store by its host: the listening address, the host's own name and a configured alias are
    served; any other Host header is refused (MLflow's DNS-rebinding guard stays on)."""
    import socket
    from urllib.parse import urlparse

    import requests

    assert urlparse(team_store).hostname == STORE_ADDRESS
    port = urlparse(team_store).port
    api = f"{team_store}/api/2.0/mlflow/experiments/search?max_results=1"
    login = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
    for name in (STORE_ADDRESS, socket.gethostname(), "store-host"):
        assert requests.get(api, headers={"Host": f"{name}:{port}"}, auth=login, timeout=30).status_code == 200, name
    refused = requests.get(api, headers={"Host": f"rebinding.example:{port}"}, auth=login, timeout=30)
    assert refused.status_code == 403 and "Invalid Host header" in refused.text


def _login(name: str, password: str) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": password}


def test_the_store_lets_in_only_who_belongs(team_store, services_env, tmp_path):
    """Logins on the served store: no login is refused (401); the admin adds two users with qexp.store; alice's qexp
    run logs normally; bob reads alice's experiment but can neither write to it nor delete her run (403) until the
    admin grants him edit; bob's qexp run there, and a wrong password, are one line each; the
    admin's password is in no process listing, log, param, tag, artifact or terminal."""
    import requests

    admin_password = services_env["MLFLOW_TRACKING_PASSWORD"]
    api = f"{team_store}/api/2.0/mlflow"
    assert requests.get(f"{api}/experiments/search?max_results=1", timeout=30).status_code == 401
    passwords = {}
    for name in ("alice", "bob"):
        added = subprocess.run([sys.executable, "-m", "qexp.store", "--uri", team_store, "user", "add", name,
                                "--password-file", str(tmp_path / name)], cwd=REPO, env=services_env,
                               capture_output=True, text=True, timeout=120)
        assert added.returncode == 0, added.stderr
        assert oct(os.stat(tmp_path / name).st_mode & 0o777) == "0o600"
        passwords[name] = (tmp_path / name).read_text().strip()
        assert passwords[name] not in added.stdout + added.stderr
    run = [sys.executable, "-m", "qexp", *TINY, "tracking=server", f"tracking.uri={team_store}",
           "tracking.experiment=alice_exp", f"cache_dir={tmp_path / 'cache'}"]
    alice = subprocess.run(run, cwd=REPO, env=_login("alice", passwords["alice"]), capture_output=True, text=True,
                           timeout=900)
    assert alice.returncode == 0, alice.stderr[-2000:]
    [alice_run] = _runs(team_store, "alice_exp")
    experiment_id = alice_run.info.experiment_id
    bob = ("bob", passwords["bob"])
    assert requests.get(f"{api}/runs/get", params={"run_id": alice_run.info.run_id}, auth=bob, timeout=30).ok
    create = {"experiment_id": experiment_id, "start_time": 0}
    assert requests.post(f"{api}/runs/create", json=create, auth=bob, timeout=30).status_code == 403
    assert requests.post(f"{api}/runs/delete", json={"run_id": alice_run.info.run_id}, auth=bob,
                         timeout=30).status_code == 403
    started = time.time()
    refused = subprocess.run(run, cwd=REPO, env=_login(*bob), capture_output=True, text=True, timeout=300)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("qexp: error:")]
    assert refused.returncode != 0 and len(errors) == 1 and time.time() - started < 60, refused.stderr[-2000:]
    assert "refused user 'bob': no permission to write a run to experiment 'alice_exp'" in errors[0]
    wrong = subprocess.run(run, cwd=REPO, env=_login("alice", "not-her-password"), capture_output=True, text=True,
                           timeout=300)
    assert wrong.returncode != 0 and "refused user 'alice': not logged in" in wrong.stderr, wrong.stderr[-2000:]
    # the report reads the store with the same login: bob's table of alice's runs; a wrong password is one line
    report = [sys.executable, "-m", "qexp.report", "--experiment", "alice_exp", "--tracking-uri", team_store,
              "--out-dir", str(tmp_path / "results"), "--name", "alice"]
    table = subprocess.run(report, cwd=REPO, env=_login(*bob), capture_output=True, text=True, timeout=300)
    assert table.returncode == 0 and (tmp_path / "results" / "alice.md").exists(), table.stderr[-2000:]
    refused_table = subprocess.run(report, cwd=REPO, env=_login("bob", "wrong"), capture_output=True, text=True,
                                   timeout=300)
    errors = [line for line in refused_table.stderr.splitlines() if line.startswith("qexp.report: error:")]
    assert refused_table.returncode == 2 and len(errors) == 1, refused_table.stderr[-2000:]
    assert "Traceback" not in refused_table.stderr
    assert "refused user 'bob': not logged in" in refused_table.stderr
    granted = subprocess.run([sys.executable, "-m", "qexp.store", "--uri", team_store, "grant", "alice_exp", "bob",
                              "edit"], cwd=REPO, env=services_env, capture_output=True, text=True, timeout=120)
    assert granted.returncode == 0, granted.stderr
    assert requests.post(f"{api}/runs/create", json=create, auth=bob, timeout=30).ok
    # the admin's password: in no process's command line, the server's log, the run's record or any output
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    server_log = Path(services_env["QEXP_SERVICES_DIR"], "log", "mlflow.log").read_text()
    client = MlflowClient(team_store)
    record = str(alice_run.data.params) + str(alice_run.data.tags)
    artifacts = ""
    for name in ("config.yaml", "run.log"):
        artifacts += Path(client.download_artifacts(alice_run.info.run_id, name, str(tmp_path))).read_text()
    for where, text in (("ps", listing), ("mlflow.log", server_log), ("params/tags", record),
                        ("artifacts", artifacts), ("output", alice.stdout + alice.stderr + refused.stderr)):
        assert admin_password not in text and passwords["alice"] not in text, where


def test_a_server_on_the_labs_own_postgresql(team_store, services_env, tmp_path):
    """QEXP_MLFLOW_DATABASE_URI / QEXP_MLFLOW_AUTH_DATABASE_URI: a second server on the databases the team store
    uses (standing in for a lab's own PostgreSQL) starts no PostgreSQL of its own and serves the same runs, behind
    the same logins; without the logins' database it refuses to start, in one line."""
    import requests

    folder = tmp_path / "services"
    folder.mkdir()
    os.chmod(folder, 0o755)
    env = {**services_env, "QEXP_SERVICES_DIR": str(folder), "QEXP_MLFLOW_PORT": str(free_port()),
           "QEXP_MLFLOW_DATABASE_URI": _service("postgres.sh", "uri", services_env).stdout.strip(),
           "QEXP_MLFLOW_AUTH_DATABASE_URI": _service("postgres.sh", "auth-uri", services_env).stdout.strip()}
    started = _service("mlflow_server.sh", "start", env)
    try:
        assert started.returncode == 0, started.stderr
        uri = started.stdout.strip().splitlines()[-1]
        assert not (folder / "pg").exists()  # no PostgreSQL of its own
        assert requests.get(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30).status_code == 401
        assert ({e.name for e in MlflowClient(uri).search_experiments()}
                == {e.name for e in MlflowClient(team_store).search_experiments()})  # the same store, same admin
    finally:
        _service("mlflow_server.sh", "stop", env)
    refused = _service("mlflow_server.sh", "start", {**env, "QEXP_MLFLOW_AUTH_DATABASE_URI": ""})
    assert refused.returncode != 0 and "QEXP_MLFLOW_AUTH_DATABASE_URI" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_serving_beyond_loopback_without_logins_is_refused(services_env):
    out = _service("mlflow_server.sh", "start", {**services_env, "QEXP_MLFLOW_AUTH": "off",
                                                 "QEXP_MLFLOW_HOST": "0.0.0.0"})
    assert out.returncode != 0 and "QEXP_MLFLOW_TRUSTED_NETWORK=1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def _runs(uri: str, experiment: str):
    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def _job_runs(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return [r for r in runs if r.data.tags.get("qexp.role") != "sweep"]


def _gone(pid: int) -> bool:
    try:
        return re.search(r"^State:\s*Z", Path(f"/proc/{pid}/status").read_text(), re.M) is not None  # a zombie
    except FileNotFoundError:
        return True


def test_a_sweep_on_the_postgresql_store_rides_out_its_restarts(team_store, services_env, tmp_path):
    """A 3-job sweep logs to the PostgreSQL-backed server, artifacts served by it. The server is killed as the second
    job's run starts and started again; PostgreSQL is restarted as the third's starts. The runs wait for their store:
    all three finish with their metrics and artifacts, and the sweep exits 0."""
    args = ["-m", *TINY, "quant=16a8w", "eval.limit=2,3,4", "tracking=server", f"tracking.uri={team_store}",
            "tracking.experiment=pg_faults", f"cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    sweep = subprocess.Popen([sys.executable, "-m", "qexp", *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        for jobs, restart in ((2, "server"), (3, "postgres")):
            deadline = time.time() + 600
            while len(_job_runs(team_store, "pg_faults")) < jobs and time.time() < deadline:
                time.sleep(0.2)
            if restart == "server":
                pid = int(Path(services_env["QEXP_SERVICES_DIR"], "mlflow.pid").read_text())
                os.killpg(pid, signal.SIGKILL)
                deadline = time.time() + 30
                while not _gone(pid) and time.time() < deadline:  # dying still counts as running for the script
                    time.sleep(0.1)
                restarted = _service("mlflow_server.sh", "start", services_env)
            else:
                assert _service("postgres.sh", "stop", services_env).returncode == 0
                restarted = _service("postgres.sh", "start", services_env)
            assert restarted.returncode == 0, restarted.stderr
        stdout, stderr = sweep.communicate(timeout=900)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, stderr[-3000:]
    assert "3 finished, 0 failed" in stdout, stdout[-2000:]
    runs = _job_runs(team_store, "pg_faults")
    client = MlflowClient(team_store)
    assert len(runs) == 3 and all(r.info.status == "FINISHED" and "ppl_qdq" in r.data.metrics for r in runs)
    assert all({"config.yaml", "run.log"} <= {a.path for a in client.list_artifacts(r.info.run_id)} for r in runs)


# One sweep, six SLURM jobs: two that finish, one that raises, three that wait on a cache entry this test holds
# (a build in progress elsewhere, as far as they know): one reaches its time limit, one is cancelled with scancel, one
# is killed with SIGKILL (as the OOM killer would), so that it cannot say why.
JOBS = {
    "fp32": "quant: {name: fp32}",
    "a16w8": "defaults:\n  - override /quant: 16a8w",
    "raises": "export:\n  max_context_len: 32",  # shorter than the windows: refused inside the run, FAILED
    "times_out": "model:\n  tiny:\n    seed: 101",
    "cancelled": "model:\n  tiny:\n    seed: 102",
    "lost": "model:\n  tiny:\n    seed: 103",  # SIGKILLed: it cannot say why; the launcher asks sacct
}


def _job_configs(folder: Path) -> Path:
    group = folder / "slurmtest"
    group.mkdir(parents=True)
    for name, body in JOBS.items():
        (group / f"{name}.yaml").write_text(f"# @package _global_\n{body}\n")
    return folder


def _hold_tiny_model_entries(compose, cache: Path, seeds, release: threading.Event, held: threading.Event):
    import contextlib

    from qexp.cache import Cache, stable_hash
    from qexp.models.tiny import tiny_key

    with contextlib.ExitStack() as stack:
        for seed in seeds:
            spec = compose(TINY + [f"model.tiny.seed={seed}"], tracked=False).model.tiny
            stack.enter_context(Cache(cache).lock("tiny", stable_hash(tiny_key(spec))))
        held.set()
        release.wait()


def _slurm_job_of_waiting_run(uri: str, seed: str, timeout: float = 400, experiment: str = "slurm") -> dict:
    """The tags (SLURM job, as ARRAYJOB_TASK in an array of several, pid) of the RUNNING run for the tiny model of
    `seed`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        time.sleep(1)
        if MlflowClient(uri).get_experiment_by_name(experiment) is None:
            continue
        waiting = [r for r in _runs(uri, experiment) if r.info.status == "RUNNING"
                   and r.data.params.get("model.tiny.seed") == seed]
        if waiting:
            assert experiment != "slurm" or "_" in waiting[0].data.tags["qexp.slurm_job_id"]
            return waiting[0].data.tags
    raise AssertionError(f"the job for seed {seed} never started its run")


def test_a_sweep_of_real_slurm_jobs(slurm, team_store, compose, tmp_path):
    conf, cache = _job_configs(tmp_path / "conf"), tmp_path / "cache"
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_tiny_model_entries, args=(compose, cache, (101, 102, 103), release, held))
    holder.start()
    assert held.wait(120)

    def sweep(folder: str, timeout_min: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "qexp", "-m", *TINY, f"+slurmtest={','.join(JOBS)}", "hydra/launcher=slurm",
             f"hydra.launcher.timeout_min={timeout_min}", "hydra.launcher.signal_delay_s=60",
             "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=3", "hydra.launcher.array_parallelism=2", f"hydra.searchpath=[file://{conf}]",
             f"hydra.sweep.dir={tmp_path / folder}", "tracking=server", f"tracking.uri={team_store}",
             "tracking.experiment=slurm", f"cache_dir={cache}"],
            cwd=REPO, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # the time-limit warning ~180 s into each job (SLURM checks every ~30 s): the others need ~20-60 s alone, and
    # one CI run saw a finishing job pass 108 s with the suite's other workers on the same two cores
    first = sweep("sweep", timeout_min=4)
    try:
        subprocess.run(["scancel", _slurm_job_of_waiting_run(team_store, "102")["qexp.slurm_job_id"]], env=slurm,
                       check=True)
        os.kill(int(_slurm_job_of_waiting_run(team_store, "103")["qexp.pid"]), signal.SIGKILL)  # as the OOM killer
        stdout, stderr = first.communicate(timeout=600)
    finally:
        first.kill()
        release.set()
        holder.join()
    assert first.returncode == 1, stderr[-3000:]
    assert "2 finished, 4 failed, 0 skipped" in stdout, stdout[-2000:] + stderr[-2000:]

    runs = [r for r in _runs(team_store, "slurm") if r.data.tags.get("qexp.role") != "sweep"]
    status = {r.data.tags["qexp.sweep_overrides"].split("slurmtest=")[1].split()[0]: r for r in runs}
    assert {name: r.info.status for name, r in status.items()} == {
        "fp32": "FINISHED", "a16w8": "FINISHED", "raises": "FAILED", "times_out": "KILLED", "cancelled": "KILLED",
        "lost": "KILLED"}
    assert "export.max_context_len=32" in status["raises"].data.tags["error"]
    assert "time limit" in status["times_out"].data.tags["qexp.killed_reason"]
    assert "SLURM job" in status["times_out"].data.tags["qexp.killed_reason"]
    assert "CANCELLED by" in status["cancelled"].data.tags["qexp.killed_reason"]
    # the lost job's run: ended by its watchdog or by the launcher, whichever came first; the launcher records the job
    assert status["lost"].data.tags["qexp.killed_reason"]
    assert "+slurmtest=lost" in stderr and "never reported back" in stderr
    parent = [r for r in _runs(team_store, "slurm") if r.data.tags.get("qexp.role") == "sweep"][0]
    assert parent.data.tags["launcher"].endswith("qexp_slurm_launcher.launcher.SlurmLauncher")
    assert parent.data.metrics["jobs_total"] == 6 and parent.info.status == "FAILED"
    # the jobs logged in through the environment they inherited: the password is in no job script, log or output
    password = slurm["MLFLOW_TRACKING_PASSWORD"]
    written = [p for p in (tmp_path / "sweep").rglob("*") if p.is_file() and password in p.read_text(errors="ignore")]
    assert not written and password not in stdout + stderr, written

    # the re-run, the cache entries free now and a longer time limit: what finished is skipped, the rest runs
    rerun = sweep("rerun", timeout_min=5)
    stdout, stderr = rerun.communicate(timeout=900)
    assert rerun.returncode == 1 and "3 finished, 1 failed, 2 skipped" in stdout, stdout[-2000:] + stderr[-2000:]


def _wait_until_idle(slurm: dict, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        queue = subprocess.run(["squeue", "-h"], env=slurm, capture_output=True, text=True).stdout.strip()
        if not queue:
            return
        time.sleep(2)
    raise AssertionError(f"SLURM still busy after {timeout:.0f} s: {queue}")


def _slurm_accounting(slurm: dict) -> str:
    """What SLURM did with the jobs (for a failure message)."""
    return subprocess.run(["sacct", "-X", "--format=JobID,Partition,State,Start,End,Reason"], env=slurm,
                          capture_output=True, text=True).stdout[-2000:]


def test_a_preempted_job_is_requeued_and_finishes(slurm, team_store, compose, tmp_path):
    """A job of the pre-emptible partition (debug), waiting on a cache entry this test holds, is pre-empted by a job
    of the urgent partition that needs the whole node: SLURM sends it submitit's USR2 at once, submitit requeues it,
    and its run ends KILLED as requeued; once the node is free the requeued job (same SLURM job) runs again in a new
    run and finishes, and the sweep ends as one finished job."""
    _wait_until_idle(slurm)  # an empty queue: a job left by the test before would hold CPUs the urgent job needs
    cache = tmp_path / "cache"
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_tiny_model_entries, args=(compose, cache, (104,), release, held))
    holder.start()
    assert held.wait(120)
    sweep = subprocess.Popen(
        [sys.executable, "-m", "qexp", "-m", *TINY, "model.tiny.seed=104", "quant=16a8w", "hydra/launcher=slurm",
         "hydra.launcher.timeout_min=20", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=3",
         f"hydra.sweep.dir={tmp_path / 'sweep'}", "tracking=server", f"tracking.uri={team_store}",
         "tracking.experiment=preempt", f"cache_dir={cache}"],
        cwd=REPO, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job = _slurm_job_of_waiting_run(team_store, "104", experiment="preempt")["qexp.slurm_job_id"]
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-c", str(os.cpu_count()), "-t", "2",
                                 "-o", "/dev/null", "--wrap", "sleep 3"], env=slurm, capture_output=True, text=True,
                                check=True).stdout.strip()
        deadline = time.time() + 240
        while time.time() < deadline and not [r for r in _runs(team_store, "preempt") if r.info.status == "KILLED"]:
            time.sleep(1)
        release.set()
        # SLURM holds a requeued batch job for ~2 minutes (its BeginTime) before it may start again: start it now,
        # once it is pending again (while the requeue completes, the update is refused)
        deadline = time.time() + 60
        while time.time() < deadline and subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                                                        env=slurm, capture_output=True).returncode != 0:
            time.sleep(1)
        stdout, stderr = sweep.communicate(timeout=600)
    finally:
        sweep.kill()
        release.set()
        holder.join()
    assert sweep.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert "1 finished, 0 failed, 0 skipped" in stdout, stdout[-2000:] + stderr[-2000:]
    runs = {r.info.status: r for r in _runs(team_store, "preempt") if r.data.tags.get("qexp.role") != "sweep"}
    assert set(runs) == {"KILLED", "FINISHED"}, ({r.info.run_id: r.info.status for r in runs.values()},
                                                 _slurm_accounting(slurm))
    assert "pre-empted by SLURM and requeued" in runs["KILLED"].data.tags["qexp.killed_reason"]
    assert runs["KILLED"].data.tags["config_hash"] == runs["FINISHED"].data.tags["config_hash"]
    assert runs["KILLED"].data.tags["qexp.slurm_job_id"] == runs["FINISHED"].data.tags["qexp.slurm_job_id"] == job
    state = subprocess.run(["sacct", "-X", "-n", "-P", "-j", urgent, "-o", "State"], env=slurm, capture_output=True,
                           text=True).stdout.split()
    assert state and state[0] == "COMPLETED", state
