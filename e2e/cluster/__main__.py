"""python -m e2e.cluster {up,run,pytest}

  up  [--workdir DIR]      start the control plane in a private netns, print the admin kubeconfig
                           path, block until SIGINT/SIGTERM, then stop it.
  run [--workdir DIR] [--node-agent NODE] -- CMD...
                           private netns + control plane, run CMD with KUBECONFIG set, tear down,
                           exit with CMD's code (work dir kept if CMD failed or with --keep).
  pytest [PYTEST ARGS]     python -m pytest -m e2e ARGS in a private netns; the tests' session
                           fixture starts the cluster (tests/e2e/conftest.py). Only needed when
                           not root: as root the fixture enters a netns by itself.

Binaries: --bin DIR, else $ROUTERFLEET_KUBE_BIN, else e2e/kube/build.sh (resolved before entering
the netns, which has no network). --node-agent NODE also runs the process node agent
(e2e/cluster/node_agent.py) as NODE, and tells tests/e2e (via $ROUTERFLEET_E2E_WORKDIR) to use this
cluster instead of starting one. up/run always make a fresh netns (nested inside the current one if
that is private too, so two clusters never share ports); --no-netns uses the current one as it is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e2e.entrypoints import entrypoints
from e2e.provider import WORKDIR_ENV

from .binaries import ENV as BIN_ENV
from .binaries import kube_bin_dir
from .cluster import Cluster, ClusterError
from .netns import reexec_in_netns, unshare_command


def _say(msg: str) -> None:
    print(f"[e2e.cluster] {msg}", file=sys.stderr, flush=True)


def _sigterm(signum, frame):  # turn SIGTERM into a clean unwind through the finally blocks
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m e2e.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("up", "run"):
        p = sub.add_parser(name)
        p.add_argument("--workdir", type=Path, help="PKI, etcd data, logs, kubeconfigs")
        p.add_argument("--bin", type=Path, help="dir with etcd, kube-apiserver, ... (default: build.sh)")
        p.add_argument("--no-netns", action="store_true", help="do not create a private netns")
        p.add_argument("--node-agent", metavar="NODE", help="also run e2e.cluster.node_agent as NODE")
        p.add_argument("-v", "--verbosity", type=int, default=1, help="klog --v for the components")
        if name == "run":
            p.add_argument("--keep", action="store_true", help="keep the work dir")
            p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pytest"]:  # everything after it belongs to pytest
        os.environ[BIN_ENV] = str(kube_bin_dir())  # may build: needs the network, so before unshare
        cmd = [sys.executable, "-m", "pytest", "-m", "e2e", *argv[1:]]
        reexec_in_netns(cmd)  # does not return unless already in the netns
        os.execv(cmd[0], cmd)
    sub.add_parser("pytest", help="run the e2e tests in a private netns: pytest [PYTEST ARGS]")
    a = ap.parse_args(argv)

    if a.cmd == "run":
        if a.command[:1] == ["--"]:
            a.command = a.command[1:]
        if not a.command:
            ap.error("run needs a command after --")

    if a.bin:
        os.environ[BIN_ENV] = str(a.bin.resolve())
    if a.workdir:
        a.workdir.mkdir(parents=True, exist_ok=True)
    if not a.no_netns:  # always a fresh netns (nested if need be): never the ports of another cluster
        os.environ[BIN_ENV] = str(kube_bin_dir())  # may build: needs the network, so before unshare
        cmd = unshare_command([sys.executable, "-m", "e2e.cluster", argv[0], "--no-netns", *argv[1:]])
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(cmd[0], cmd)

    signal.signal(signal.SIGTERM, _sigterm)
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="routerfleet-cluster-"))
    cluster = Cluster(kube_bin_dir(), workdir, verbosity=a.verbosity)
    t0 = time.monotonic()
    rc = 1
    try:
        cluster.start()
        if a.node_agent:
            cluster.start_node_agent(a.node_agent, entrypoints())
        _say(f"control plane ready in {time.monotonic() - t0:.1f}s; logs in {cluster.logs}")
        if a.cmd == "up":
            _say(
                f"enter the netns with: nsenter --net=/proc/{os.getpid()}/ns/net "
                f"(add --user --preserve-credentials when not root); Ctrl-C stops"
            )
            print(cluster.kubeconfig, flush=True)
            while True:
                cluster.check_alive()
                time.sleep(1)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        if a.node_agent:  # tests/e2e reuse this cluster instead of starting their own
            env[WORKDIR_ENV] = str(workdir)
        env["PATH"] = f"{cluster.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        child = subprocess.Popen(a.command, env=env)
        try:
            rc = child.wait()
        finally:
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
        return rc
    except ClusterError as e:
        _say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        rc = 0 if a.cmd == "up" else 130
        return rc
    finally:
        cluster.stop()
        if a.cmd == "run" and not a.workdir:
            if rc == 0 and not a.keep:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                _say(f"work dir kept: {workdir}")


if __name__ == "__main__":
    sys.exit(main())
