"""A run's saved state: every key a multiloss checkpoint holds beyond Lightning's own, with its owner, and the format.

Lightning writes ``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks`` (a
callback's own state: `RngState`'s ``rng``, ModelCheckpoint's), ``hyper_parameters``, ``epoch`` and
``global_step``. multiloss adds the keys of `SAVED_KEYS`, each written and read by the one owner named
there; a module that reads or writes one imports its name from here, so a new key is declared here
first. The format question — a checkpoint is a file (one device, DDP) or a sharded directory
(FSDP2: ``.distcp`` shards, ``.metadata`` and ``meta.pt``) — is answered here too
(`is_sharded_checkpoint`); reading either whole is `multiloss.saving.checkpoints`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The run that wrote the checkpoint (multiloss.callbacks.run_record.RunRecord).
OVERRIDES_KEY = "multiloss_overrides"  # its command-line overrides: multiloss-eval rebuilds the recipe from them
CONFIG_DIRS_KEY = "multiloss_config_dirs"  # the config dirs it added (--config-dir)
SPLIT_KEY = "multiloss_data_split"  # its data split (val_fraction, test_fraction, split_seed)
POSITION = "position"  # the training loader's state: its epoch and the examples of its order consumed
BATCHES_KEY = "multiloss_batches"  # the per-rank batch size and the ranks its position in the epoch is counted in
HISTORY_KEY = "multiloss_metrics_csv"  # its metrics.csv, continued by a resumed run (multiloss.saving.history)
# The step's state (multiloss.base.learning_rate, multiloss.multitask.recipe, the recipes).
LR_KEY = "multiloss_learning_rates"  # each optimizer's RatePlan: configured rate × rule × schedule factor
TASKS_KEY = "multiloss_balanced_tasks"  # the task names the balancer was built for (built before the weights load)
OLD_HEAD_COUNT_KEY = "multihead_heads"  # read only: multihead's head count in checkpoints older than TASKS_KEY
STEP_KEY = "multiloss_step"  # how the step weighed its micro-batches (accumulation_mean): absent, an earlier version's
NOISE_KEY = "gan_noise_state"  # the GAN's training-noise generator (a uint8 tensor: weights_only loads it)
NOISE_DRAW_KEY = "gan_noise_draw"  # how it turns its numbers into normals: absent, an earlier version's (randn)
D_STEPS_KEY = "gan_d_steps"  # the GAN's discriminator steps so far: its lazy penalty's phase
G_STEPS_KEY = "gan_g_steps"  # the GAN's generator steps so far: its lazy path-length phase
IMAGES_KEY = "gan_images_seen"  # the images D has trained on so far
SCHEDULED_AT_KEY = (
    "gan_scheduled_at"  # the images seen at the iteration's start: the clock of the schedules over images
)
VOCABULARY_KEY = "vocab"  # the tbptt vocabulary its token ids mean
CARRIED_KEY = "tbptt_carried_state"  # tbptt streams: every rank's state carried into the next batch


@dataclass(frozen=True)
class SavedKey:
    name: str
    owner: str  # the module that writes it (and reads it back); a sharded checkpoint keeps it whole, in meta.pt


SAVED_KEYS = (
    SavedKey(OVERRIDES_KEY, "multiloss.callbacks.run_record"),
    SavedKey(CONFIG_DIRS_KEY, "multiloss.callbacks.run_record"),
    SavedKey(SPLIT_KEY, "multiloss.callbacks.run_record"),
    SavedKey(BATCHES_KEY, "multiloss.callbacks.run_record"),
    SavedKey(HISTORY_KEY, "multiloss.callbacks.run_record"),
    SavedKey(LR_KEY, "multiloss.base.learning_rate"),
    SavedKey(TASKS_KEY, "multiloss.multitask.recipe"),
    SavedKey(STEP_KEY, "multiloss.base.module"),
    SavedKey(NOISE_KEY, "multiloss.recipes.gan"),
    SavedKey(NOISE_DRAW_KEY, "multiloss.recipes.gan"),
    SavedKey(D_STEPS_KEY, "multiloss.recipes.gan"),
    SavedKey(G_STEPS_KEY, "multiloss.recipes.gan"),
    SavedKey(IMAGES_KEY, "multiloss.recipes.gan"),
    SavedKey(SCHEDULED_AT_KEY, "multiloss.recipes.gan"),
    SavedKey(VOCABULARY_KEY, "multiloss.recipes.tbptt"),
    SavedKey(CARRIED_KEY, "multiloss.recipes.tbptt"),
)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint (``trainer=fsdp``'s): a directory of ``.distcp`` shards, their
    ``.metadata`` and meta.pt."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def checkpoint_exists(path: str | Path) -> bool:
    """A checkpoint file, or a sharded checkpoint's directory."""
    return Path(path).is_file() or is_sharded_checkpoint(path)
