"""A run on several processes, from the command to the last collective: the one answer to "one device, DDP or FSDP2?"
(`parallelism`), the ranks started before the imports (`early_ranks`, `child_command`) and meeting with a bounded
wait in a store of their run's own (`rendezvous`, on a port held until it listens: `ports`), Lightning's DDP and
FSDP2 strategies as multiloss runs them (`ddp`, `fsdp`), the networks sharded or held whole for a step (`sharding`),
and a collective not every rank reached (`stalls`)."""
