"""Federated training over loopback with Flower's deployment runtime: one SuperLink, three SuperNodes.

    python examples/federated/run_loopback.py [--rounds 10] [--workdir DIR]

needs ``pip install onnxtrain[flower]`` (flwr 1.41). It generates the artifacts (no torch), trains the
same artifacts centrally on the pooled data for as many epochs as the federation runs (the reference
accuracy), then starts ``flower-superlink``, three ``flower-supernode`` s (partition-id 0..2, label-skewed
data) and ``flwr run``; the ServerApp prints the global model's accuracy on a balanced test set per
round. Nothing leaves 127.0.0.1; Flower's update checks, telemetry and dependency installs are off.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fedmlp.data import global_test, pooled_train  # noqa: E402
from fedmlp.model import build_artifacts  # noqa: E402

from onnxtrain.federated import OnDeviceClient, batches  # noqa: E402

OFFLINE = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_TELEMETRY_ENABLED": "0"}
NODES = 3


def centralised_accuracy(artifact_dir: Path, epochs: int, lr: float, batch_size: int) -> list[float]:
    """Accuracy on the global test set after each epoch of training on all nodes' data pooled."""
    client = OnDeviceClient(artifact_dir)
    x, y = pooled_train(NODES)
    xt, yt = global_test()
    arrays, accs = None, []
    for epoch in range(epochs):
        arrays, _, _ = client.fit(arrays, list(batches(x, y, batch_size, seed=epoch)), learning_rate=lr)
        accs.append(client.evaluate(arrays, batches(xt, yt, 500))[1]["accuracy"])
    return accs


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _wait_for_port(port: int, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the SuperLink did not open port {port} in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def run_federation(artifact_dir: Path, workdir: Path, rounds: int, lr: float, batch_size: int, port: int,
                   timeout: float) -> tuple[list[float], float]:
    env = {**os.environ, **OFFLINE, "FLWR_HOME": str(workdir / "flwr-home")}
    src = Path(__file__).resolve().parents[2] / "src"
    # Flower starts its helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by name from PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(src), env.get("PYTHONPATH", "")) if p)
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{port}"\n'
        'insecure = true\n')
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    procs = []

    def start(name, args):
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process below)
        procs.append((subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir), log))

    try:
        start("superlink", [_bin("flower-superlink"), "--insecure", "--database", str(workdir / "state.db"),
                            "--host", "127.0.0.1", "--port", str(port)])
        _wait_for_port(port, 60, logs / "superlink.log")
        for k in range(NODES):
            start(f"supernode{k}", [_bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                                    "--port", str(port + 10 + k),
                                    "--node-config", f"partition-id={k} num-partitions={NODES}"])
        config = (f"artifacts='{artifact_dir}' num-server-rounds={rounds} min-nodes={NODES} "
                  f"learning-rate={lr} batch-size={batch_size}")
        started = time.perf_counter()
        run = subprocess.run([_bin("flwr"), "run", str(HERE), "loopback", "--stream", "--run-config", config],
                             env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False)
        elapsed = time.perf_counter() - started
        out = run.stdout + run.stderr
        accs = {int(r): float(a) for r, a in re.findall(r"\[global\] round (\d+): .*?accuracy=([0-9.]+)", out)}
        if run.returncode != 0 or len(accs) != rounds + 1:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
            raise RuntimeError(f"flwr run exited {run.returncode} with {len(accs)} of {rounds + 1} evaluations:\n"
                               f"{out[-4000:]}\n{tails}")
        return [accs[r] for r in range(rounds + 1)], elapsed
    finally:
        for proc, log in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--port", type=int, default=19092, help="the SuperLink's loopback port; SuperNodes take port+10..port+12")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="onnxtrain-fl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    artifact_dir = workdir / "artifacts"
    build_artifacts(artifact_dir, lr=args.lr)
    central = centralised_accuracy(artifact_dir, args.rounds, args.lr, args.batch_size)
    print(f"centralised: accuracy after {args.rounds} epochs on the pooled data = {central[-1]:.4f}", flush=True)
    federated, elapsed = run_federation(artifact_dir, workdir, args.rounds, args.lr, args.batch_size, args.port,
                                        args.timeout)
    for r, acc in enumerate(federated):
        print(f"federated round {r}: global accuracy {acc:.4f}")
    reached = next((r for r, a in enumerate(federated) if a >= central[-1] - 0.01), None)
    print(f"federated: {federated[-1]:.4f} after {args.rounds} rounds ({elapsed:.1f} s); centralised "
          f"{central[-1]:.4f}; within 1 point of centralised from round {reached}")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
