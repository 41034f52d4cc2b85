"""The GAN's parts, beside its loop (`multiloss.recipes.gan`): the losses and penalties (`objectives`), what D sees
(`augment`: DiffAugment, ADA), the moving average of G (`ema`), the offline quality metrics (`metrics`) and the
versioned digits classifier they score in (`digit_features`, its weights in ``multiloss/assets``)."""
