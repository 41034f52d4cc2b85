"""Entry point: ``python train.py recipe=<name> [key=value ...]``; ``python train.py --help`` lists recipes."""

import hydra
from omegaconf import DictConfig

from multiloss.cli import run


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> dict[str, float]:
    return run(cfg)


if __name__ == "__main__":
    main()
