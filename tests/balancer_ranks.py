"""Every balancer's distributed paths in one 2-process group (gloo), started once: run by ``test_balancer_parity``.

Each rank runs, for every method, the same 3 steps on fixed float64 data four ways and writes (rank zero) the largest
weight differences to a JSON file:

- ``one``: one device on the whole batch of 32 (every rank computes it alike): the reference;
- ``ddp``: the net replicated, each rank its half of the batch, the balancer protocol with the ranks' mean (the
  recipe's ``mean_over_ranks``), then every gradient averaged over the ranks (DDP's all-reduce);
- ``fsdp_global``: the net sharded by FSDP2 (`multiloss.parallel.sharding.shard_components`), a gradient rule of
  ``scope=global`` on the shards (`multiloss.balancers.sharded_rule`), a scalarization's weights through FSDP2's
  own backward;
- ``fsdp_rank``: the net sharded but held whole for its step (`multiloss.parallel.sharding.LocalGradients`), a gradient
  rule of ``scope=rank`` on each rank's whole gradients.

The ranks' random draws (RLW, GradVac, GradDrop) are seeded alike before each step, as Lightning's seed does.
"""

from __future__ import annotations

import datetime
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from multiloss.balancers.build import build_balancer
from multiloss.lightning_internals import destroy_process_group
from multiloss.testing import balancer_backward
from tests.test_balancer_parity import BASE, TASKS, Net, _data, _losses

STEPS, LR = 3, 0.05


def _average(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor / dist.get_world_size()


LAYER_STEPS: dict[str, int] = {}  # way -> the steps the layer Gramian planned (the last method's run)


def _run(spec: dict, way: str, rank: int) -> list[torch.Tensor]:
    holder = nn.Module()
    holder.net = Net().double()
    balancer = build_balancer(spec, TASKS, BASE, holder.net, "model.balancer").double()
    x, y = _data()
    if way != "one":
        x, y = x[rank * 16 : (rank + 1) * 16], y[rank * 16 : (rank + 1) * 16]
    mean = (lambda t: t) if way == "one" else _average
    total = (lambda t: t) if way == "one" else (lambda t: _average(t) * dist.get_world_size())
    held = None
    if way.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        from multiloss.parallel.sharding import shard_components

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        whole = ["net"] if way == "fsdp_rank" else []
        held = shard_components(holder, ["net"], mesh, held_whole=whole).get("net")
    net = holder.net
    parallelism = SimpleNamespace(sharded=way.startswith("fsdp"), held={"net": held} if held is not None else {})
    optimizer = torch.optim.SGD([*net.parameters(), *balancer.parameters()], lr=LR)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        block = held.step(True) if held is not None else _nothing()
        with block:  # the forward inside: under FSDP2 held whole, the step's graph is on the whole weights
            if balancer.batches_per_step > 1:  # SDMGrad, MoDo: each rank's batch in draws, as the recipe splits it
                n = balancer.batches_per_step
                parts = zip(torch.tensor_split(x, n), torch.tensor_split(y, n))
                losses = [dict(zip(TASKS, _losses(net, xs, ys)[1])) for xs, ys in parts]
            else:
                losses = dict(zip(TASKS, _losses(net, x, y)[1]))
            balancer_backward(balancer, losses, net, parallelism, mean, total)
        if way == "ddp":
            for p in net.parameters():
                p.grad = _average(p.grad) if p.grad is not None else _average(torch.zeros_like(p))
        if way != "one":  # the balancer's own parameters: replicated, averaged as DDP (or the recipe, under FSDP2) does
            for p in balancer.parameters():
                if p.grad is not None:
                    p.grad = _average(p.grad)
        optimizer.step()
        if balancer.after_step_update:
            with torch.no_grad():
                balancer.after_step(torch.stack(_losses(net, x, y)[1]))
    layers = getattr(balancer, "_layers", None)
    # The steps the layer Gramian's plan served: segment by segment, or the K gradients where they hold no more.
    LAYER_STEPS[way] = 0 if layers is None else layers.steps + layers.by_gradients
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in net.parameters()]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> bool:
        return False


def main() -> None:
    """``argv``: the JSON file of the methods (name -> its config and the ways to prove), and the JSON file to write."""
    with open(sys.argv[1]) as f:
        methods = json.load(f)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a mismatch fails, not hangs
    rank = dist.get_rank()
    results: dict[str, dict[str, float]] = {}
    for name, method in methods.items():
        spec, ways = method["spec"], method["ways"]
        print(f"rank {rank}: {name} {ways}", file=sys.stderr, flush=True)
        if ways == ["fsdp_rank_vs_ddp"]:  # scope=rank: each rank's own rule; FSDP2 held whole against DDP
            ddp, fsdp = _run(spec, "ddp", rank), _run(spec, "fsdp_rank", rank)
            results[name] = {"fsdp_rank_vs_ddp": _largest(ddp, fsdp)}
            results[name]["layer_steps"] = [LAYER_STEPS["ddp"], LAYER_STEPS["fsdp_rank"]]
            continue
        reference = _run(spec, "one", rank)  # scope=global: one device on the global batch
        results[name] = {way: _largest(_run(spec, way, rank), reference) for way in ways}
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f, indent=1)
    # Both ranks done with the group (rank 0 wrote the file), then the teardown the CLI does (the FSDP2 nets'
    # cycles freed first): a CI run once saw rank 1 abort at its exit while rank 0 was still writing.
    dist.barrier()
    destroy_process_group()


def _largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


if __name__ == "__main__":
    main()
