"""One readable file per training recipe; each holds its LightningModule, top to bottom."""
