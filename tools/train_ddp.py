"""torchrun entry point: one DDP rank of the notebook's training (trainer.ddp_worker).

    AT_PRESET=gpu torchrun --standalone --nproc-per-node=8 tools/train_ddp.py

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the preset comes
from AT_PRESET and the data folder from AT_DATA_DIR (default data/).
"""

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import annotated_transformer as at  # noqa: E402
import trainer  # noqa: E402


def main() -> None:
    if "RANK" not in os.environ:
        sys.exit("run this under torchrun, e.g. torchrun --nproc-per-node=2 tools/train_ddp.py")
    settings = at.get_settings(os.environ.get("AT_PRESET"))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data_dir = os.environ.get("AT_DATA_DIR", str(at.DATA_DIR))
    trainer.ddp_worker(rank, world_size, dataclasses.asdict(settings), data_dir, None)


if __name__ == "__main__":
    main()
