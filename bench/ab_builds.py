"""Run one benchmark against two builds of paged_ops in the same session, alternating A, B, A, B...

A refactor must not be slower, and on a shared machine only measurements taken side by side say
so. Each build is a non-editable install in a folder of its own:

  PAGED_OPS_CUDA=off pip install --no-build-isolation --no-deps --target /tmp/before_site .   # at the old commit
  PAGED_OPS_CUDA=off pip install --no-build-isolation --no-deps --target /tmp/after_site .    # at the new one
  .venv/bin/python -m bench.ab_builds /tmp/before_site /tmp/after_site --rounds 3 -- bench.op_overhead --calls 2000

A folder given as ``-`` is this venv's own (editable) install of the working tree, run as a plain
``python -m`` from the repository.

Every run is a fresh ``python -S`` process whose path is that build's folder, then this venv's
site-packages (torch; no .pth files, so the venv's editable paged_ops cannot shadow the build),
then this repository (``bench``, the benchmark code, is the same for both). Each run's output is
printed under its build's name and round.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(site: str, module: str, args: list[str]) -> str:
    if site == "-":
        done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{module} (this venv) failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout
    path = os.pathsep.join([site, sysconfig.get_paths()["purelib"], str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path}
    # -S: no site processing, so the venv's editable-install finder is never installed; cwd is a
    # neutral folder so the repository's own paged_ops/ is not found first.
    code = f"import sys, runpy; sys.argv = [{module!r}, *{args!r}]; runpy.run_module({module!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd="/", capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{module} on {site} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="folder of build A (e.g. before the change), or - for this venv's")
    ap.add_argument("b", help="folder of build B, or - for this venv's")
    ap.add_argument("--rounds", type=int, default=2)
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    cli, command = ap.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        ap.error("name the benchmark module after --: ... -- bench.op_overhead --calls 2000")
    module, args = command[0], command[1:]
    for site in (cli.a, cli.b):
        if site != "-" and not (Path(site) / "paged_ops").is_dir():
            ap.error(f"{site} holds no paged_ops install")
    for r in range(cli.rounds):
        for name, site in (("A", cli.a), ("B", cli.b)):
            print(f"==== round {r + 1}, build {name} ({site}): {module} {' '.join(args)}", flush=True)
            print(run_once(site, module, args), flush=True)


if __name__ == "__main__":
    main()
