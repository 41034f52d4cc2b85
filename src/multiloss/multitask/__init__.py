"""The multi-task parts: the tasks a config names (`tasks`), the dense scene tasks (`dense`), and the recipe base
that weighs them with a balancer (`recipe`); the balancers themselves are `multiloss.balancers`."""
