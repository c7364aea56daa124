"""Train on real English text found on this machine and compare the validation loss with the corpus'
unigram entropy (the loss of a model that knows only byte frequencies).

    python benchmarks/train_on_text.py [--work DIR] [--steps 300] [--recipes current none] [--plot-to DIR]

The corpus: the manual pages of common commands rendered as plain text (``man`` and ``col``), or,
without ``man``, the licence texts of ``/usr/share/common-licenses``; nothing is downloaded. Each
recipe trains ``te-dist train --nproc 2 --data.path corpus.txt --steps N --recipe R`` into
``DIR/runs/<recipe>``; with several recipes ``te-dist plot`` draws them on one chart (``--plot-to``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MAN_PAGES = ("bash ls cp mv rm find grep sed tar gzip ssh git make gcc python3 man less cat sort uniq awk xargs "
             "chmod chown ps top kill du df mount curl wget apt dpkg").split()


def build_corpus(path: Path) -> str:
    """Write the corpus; returns what it is made of."""
    if shutil.which("man") and shutil.which("col"):
        env = dict(os.environ, MANWIDTH="80")
        with open(path, "wb") as out:
            for page in MAN_PAGES:
                text = subprocess.run(["man", "-P", "cat", page], capture_output=True, env=env).stdout
                out.write(subprocess.run(["col", "-b"], input=text, capture_output=True).stdout)
        if path.stat().st_size > 100_000:
            return f"man pages of {len(MAN_PAGES)} commands"
    licences = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file() and not p.is_symlink())
    path.write_bytes(b"".join(p.read_bytes() for p in licences))
    return f"{len(licences)} licence texts of /usr/share/common-licenses"


def unigram_entropy(path: Path) -> float:
    counts = np.bincount(np.frombuffer(path.read_bytes(), dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="where the corpus and the runs go (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--recipes", nargs="+", default=["current"])
    parser.add_argument("--plot-to", type=Path, help="with several recipes: where `te-dist plot` writes their chart")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="train_on_text_"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    what = build_corpus(corpus)
    entropy = unigram_entropy(corpus)
    print(f"corpus: {what}, {corpus.stat().st_size:,} bytes; unigram entropy of its bytes {entropy:.4f} nats")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    te_dist = [sys.executable, "-m", "te_dist.cli"]
    for recipe in args.recipes:
        out = work / "runs" / recipe  # not --out none: a flag's "none" is null, a new directory under te_dist_out/
        cmd = [*te_dist, "train", "--nproc", "2", "--data.path", "corpus.txt", "--steps", str(args.steps),
               "--recipe", recipe, "--out", str(out.relative_to(work)), "--overwrite"]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        step, val = vals[-1]
        print(f"recipe {recipe}: train loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}; val loss "
              + ", ".join(f"{v:.3f}@{s}" for s, v in vals)
              + f"; final {val:.4f} {'<' if val < entropy else '>='} unigram entropy {entropy:.4f}; plots {out / 'plots'}")
    if len(args.recipes) > 1 and args.plot_to:
        subprocess.run([*te_dist, "plot", *(f"runs/{r}" for r in args.recipes), "--to", str(args.plot_to.resolve())],
                       cwd=work, env=env, check=True)
        print(f"chart of {', '.join(args.recipes)}: {args.plot_to}")


if __name__ == "__main__":
    main()
