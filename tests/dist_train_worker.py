"""Run by tests/test_training.py under `mlx.launch -n 2`: trains on synthetic data, saves weights.

Usage: python dist_train_worker.py OUT_DIR
"""

import sys
from pathlib import Path

import redrafter_mlx  # noqa: F401  (a fast BLAS before mlx)
from redrafter_mlx.training import train

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from training_data import tiny_setup  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    drafter, embed, examples, cfg = tiny_setup()
    group = mx.distributed.init()
    drafter, _ = train(drafter, embed, examples, cfg, group=group)
    weights = dict(tree_flatten(drafter.parameters()))
    mx.save_safetensors(str(out / f"rank{group.rank()}-of-{group.size()}.safetensors"), weights)
