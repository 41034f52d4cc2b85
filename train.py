"""``python train.py recipe=<name> [key=value ...]`` (= ``multiloss-train``); ``--help`` lists the recipes."""

from multiloss.cli import train_main

if __name__ == "__main__":
    train_main()
