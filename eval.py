"""``python eval.py ckpt_path=<file> [key=value ...]`` (= ``multiloss-eval``): a checkpoint's metrics."""

from multiloss.cli import eval_main

if __name__ == "__main__":
    eval_main()
