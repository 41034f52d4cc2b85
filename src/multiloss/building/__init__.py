"""One place that builds a run: components from their configs (`components`), checked on a batch before the first
step (`checks`), and the data module, recipe and Trainer of a run (`run`)."""
