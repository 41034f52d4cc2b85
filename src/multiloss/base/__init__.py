"""What every recipe is built on: the contract and the step options (`module.Recipe`), the one owner of a step
(`step`), the multi-task balancing's lifecycle (`multitask`), the optimizers (`optimizers`), the learning rate and its
schedules (`learning_rate`, `schedules`, `lr_scaling`), precision (`precision`) and the training values logged
(`training_log`, `logging`)."""
