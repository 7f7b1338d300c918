"""Execute the notebook with papermill, showing where it is and how long it has run.

    python tools/run_notebook.py annotated_transformer.ipynb build/annotated_transformer.ipynb

Prints a line with the elapsed time whenever execution enters a new section of the
notebook, and passes the kernel's own output (the training progress bars among it)
straight through to this terminal as it arrives.
"""

import argparse
import datetime
import re
import sys
import time
from pathlib import Path

import nbformat
import papermill
from papermill.engines import NBClientEngine, papermill_engines
from traitlets.config import Config


class ProgressEngine(NBClientEngine):
    """papermill's nbclient engine, announcing each section as execution enters it."""

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
        titles, part, section = [], "", ""  # each cell's "Part › section" headings
        for cell in nb_man.nb.cells:
            if cell.cell_type == "markdown":
                for hashes, title in re.findall(r"^(#{2,3})\s+(.+)$", cell.source, re.MULTILINE):
                    if len(hashes) == 2:
                        part, section = title.strip(), ""
                    else:
                        section = title.strip()
            titles.append(" › ".join(t for t in (part, section) if t))
        code_cells = sum(c.cell_type == "code" for c in nb_man.nb.cells)
        start, started = time.monotonic(), nb_man.cell_start
        shown = {"title": None, "code": 0}

        def cell_start(cell, cell_index=None, **more):
            shown["code"] += cell.cell_type == "code"
            title = titles[cell_index] if cell_index is not None else ""
            if title != shown["title"]:
                shown["title"] = title
                elapsed = datetime.timedelta(seconds=int(time.monotonic() - start))
                print(f"[{elapsed}] cell {shown['code']}/{code_cells}  {title}", flush=True)
            return started(cell, cell_index, **more)

        nb_man.cell_start = cell_start
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the notebook to run")
    parser.add_argument("target", type=Path, help="where to write the executed notebook")
    args = parser.parse_args()
    if not args.source.is_file():
        sys.exit(f"{args.source} does not exist: run this from the project's folder")
    args.target.parent.mkdir(parents=True, exist_ok=True)
    papermill_engines.register("progress", ProgressEngine)
    notebook = nbformat.read(args.source, as_version=4)
    print(f"running {args.source} ({len(notebook.cells)} cells); the kernel's output follows")
    start = time.monotonic()
    papermill.execute_notebook(
        str(args.source),
        str(args.target),
        engine_name="progress",
        cwd=str(args.source.resolve().parent),
        progress_bar=False,
        # the executed notebook keeps what a progress bar last drew, not every redraw
        # (its "\r" updates); this terminal still shows the live bars
        coalesce_streams=True,
        stdout_file=sys.stdout,
        stderr_file=sys.stderr,
        # Unix sockets between us and the kernel: nothing on the network, so the kernel
        # has no reason to warn that its TCP traffic is unencrypted.
        config=Config({"KernelManager": {"transport": "ipc"}}),
    )
    elapsed = datetime.timedelta(seconds=int(time.monotonic() - start))  # 0:17:33
    print(f"[{elapsed}] done: executed notebook in {args.target}")
