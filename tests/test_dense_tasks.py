"""NYUv2's losses and metrics (`multiloss.multitask.dense`) against LibMTL's own, transcribed from
median-research-group/LibMTL at 4336804847eaa5e0b924b743d76beec7ac3fdc97, ``examples/nyu/utils.py`` lines 9-112
(SegMetric, DepthMetric, NormalMetric, SegLoss, DepthLoss, NormalLoss), on random float64 batches with void pixels:
equal over several updates (an epoch's), the losses to float64's rounding, the metrics to the float32 their results
are (ours return float32, as LibMTL's mIoU and pixel accuracy compute in float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torchmetrics.classification import MulticlassAccuracy

from multiloss.multitask import dense as dense_tasks

EXACT = 1e-10  # float64: equal up to rounding, on any CPU
U32 = 2.0**-24  # float32's unit roundoff: one rounding moves a value by at most U32 of it


class SegMetric:  # utils.py 10-31
    def __init__(self, num_classes):
        self.num_classes = num_classes
        self.record = torch.zeros((self.num_classes, self.num_classes), dtype=torch.int64)

    def update_fun(self, pred, gt):
        pred = pred.softmax(1).argmax(1).flatten()
        gt = gt.long().flatten()
        k = (gt >= 0) & (gt < self.num_classes)
        inds = self.num_classes * gt[k].to(torch.int64) + pred[k]
        self.record += torch.bincount(inds, minlength=self.num_classes**2).reshape(self.num_classes, self.num_classes)

    def score_fun(self):
        h = self.record.float()
        iu = torch.diag(h) / (h.sum(1) + h.sum(0) - torch.diag(h))
        acc = torch.diag(h).sum() / h.sum()
        return [torch.mean(iu).item(), acc.item()]


class DepthMetric:  # utils.py 34-60
    def __init__(self):
        self.abs_record, self.rel_record, self.bs = [], [], []

    def update_fun(self, pred, gt):
        binary_mask = (torch.sum(gt, dim=1) != 0).unsqueeze(1)
        pred = pred.masked_select(binary_mask)
        gt = gt.masked_select(binary_mask)
        abs_err = torch.abs(pred - gt)
        rel_err = torch.abs(pred - gt) / gt
        abs_err = (torch.sum(abs_err) / torch.nonzero(binary_mask, as_tuple=False).size(0)).item()
        rel_err = (torch.sum(rel_err) / torch.nonzero(binary_mask, as_tuple=False).size(0)).item()
        self.abs_record.append(abs_err)
        self.rel_record.append(rel_err)
        self.bs.append(pred.size()[0])

    def score_fun(self):
        records = np.stack([np.array(self.abs_record), np.array(self.rel_record)])
        batch_size = np.array(self.bs)
        return [(records[i] * batch_size).sum() / (sum(batch_size)) for i in range(2)]


class NormalMetric:  # utils.py 63-82
    def __init__(self):
        self.record = []

    def update_fun(self, pred, gt):
        pred = pred / torch.norm(pred, p=2, dim=1, keepdim=True)
        binary_mask = torch.sum(gt, dim=1) != 0
        error = (
            torch.acos(torch.clamp(torch.sum(pred * gt, 1).masked_select(binary_mask), -1, 1)).detach().cpu().numpy()
        )
        self.record.append(np.degrees(error))

    def score_fun(self):
        records = np.concatenate(self.record)
        return [
            np.mean(records),
            np.median(records),
            np.mean((records < 11.25) * 1.0),
            np.mean((records < 22.5) * 1.0),
            np.mean((records < 30) * 1.0),
        ]


def _seg_loss(pred, gt):  # utils.py 85-91
    return nn.CrossEntropyLoss(ignore_index=-1)(pred, gt.long())


def _depth_loss(pred, gt):  # utils.py 93-100
    binary_mask = (torch.sum(gt, dim=1) != 0).float().unsqueeze(1)
    return torch.sum(torch.abs(pred - gt) * binary_mask) / torch.nonzero(binary_mask, as_tuple=False).size(0)


def _normal_loss(pred, gt):  # utils.py 102-112
    pred = pred / torch.norm(pred, p=2, dim=1, keepdim=True)
    binary_mask = (torch.sum(gt, dim=1) != 0).float().unsqueeze(1)
    return 1 - torch.sum((pred * gt) * binary_mask) / torch.nonzero(binary_mask, as_tuple=False).size(0)


def _batches(n: int = 4, dtype: torch.dtype = torch.float64):
    """``n`` random batches (drawn in float32, the values then held in ``dtype``)."""
    for batch in _float32_batches(n):
        yield tuple(tuple(t.to(dtype) for t in pair) for pair in batch)


def _float32_batches(n: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        void = torch.rand(3, 1, 12, 16, generator=g) < 0.2
        label = torch.randint(0, 13, (3, 12, 16), generator=g).float().masked_fill(void[:, 0], -1)
        depth = (torch.rand(3, 1, 12, 16, generator=g) * 5 + 0.5).masked_fill(void, 0)
        normal = torch.nn.functional.normalize(torch.randn(3, 3, 12, 16, generator=g), dim=1).masked_fill(void, 0)
        # Predictions near the truth (so the thresholds split the pixels), and 13 logits per pixel.
        logits = torch.randn(3, 13, 12, 16, generator=g) + 3 * torch.nn.functional.one_hot(
            label.clamp_min(0).long(), 13
        ).permute(0, 3, 1, 2)
        yield (
            (logits, label),
            (depth + torch.randn(3, 1, 12, 16, generator=g) * 0.3, depth),
            (normal + torch.randn(3, 3, 12, 16, generator=g) * 0.4, normal),
        )


def test_the_losses_are_libmtls():
    for (logits, label), (depth_pred, depth), (normal_pred, normal) in _batches():
        assert logits.dtype == torch.float64
        # The same call (cross_entropy, ignore_index -1): the same number.
        assert torch.equal(dense_tasks.segmentation_loss(logits, label), _seg_loss(logits, label))
        # The same sums, masked by multiplication, over the same count: float64's rounding.
        torch.testing.assert_close(
            dense_tasks.depth_loss(depth_pred, depth), _depth_loss(depth_pred, depth), atol=0, rtol=EXACT
        )
        torch.testing.assert_close(
            dense_tasks.normal_loss(normal_pred, normal), _normal_loss(normal_pred, normal), atol=0, rtol=EXACT
        )


def test_the_metrics_over_an_epoch_are_libmtls():
    ours = {
        "miou": dense_tasks.MeanIoU(13),
        "pixel_acc": MulticlassAccuracy(13, average="micro", ignore_index=-1),
        "abs_err": dense_tasks.DepthError(),
        "rel_err": dense_tasks.DepthError(relative=True),
        "mean": dense_tasks.NormalAngleError("mean"),
        "median": dense_tasks.NormalAngleError("median"),
        "11.25": dense_tasks.NormalAngleError("within", 11.25),
        "22.5": dense_tasks.NormalAngleError("within", 22.5),
        "30": dense_tasks.NormalAngleError("within", 30),
    }
    seg, depth, normal = SegMetric(13), DepthMetric(), NormalMetric()
    for (logits, label), (depth_pred, depth_gt), (normal_pred, normal_gt) in _batches():
        seg.update_fun(logits, label)
        depth.update_fun(depth_pred, depth_gt)
        normal.update_fun(normal_pred, normal_gt)
        for name in ("miou", "pixel_acc"):
            ours[name].update(logits, label.long())
        for name in ("abs_err", "rel_err"):
            ours[name].update(depth_pred, depth_gt)
        for name in ("mean", "median", "11.25", "22.5", "30"):
            ours[name].update(normal_pred, normal_gt)
    theirs = dict(zip(["miou", "pixel_acc"], seg.score_fun()))
    theirs |= dict(zip(["abs_err", "rel_err"], depth.score_fun()))
    theirs |= dict(zip(["mean", "median", "11.25", "22.5", "30"], normal.score_fun()))
    computed = {name: float(metric.compute()) for name, metric in ours.items()}
    # Ours accumulate in float64 (float64 inputs; the depth sums and angles in float64, the counts integers) and
    # return float32: one rounding, ≤ U32 of the value. LibMTL's depth and normal metrics are float64 (numpy, `.item()`
    # of float64 sums) to ~1e-15; its pixel accuracy is one float32 quotient of the same integer counts as
    # torchmetrics' (the same number); its mIoU 13 float32 quotients (U32 each) averaged in float32 (≤ 12 roundings
    # of a sum of non-negative terms, U32 each), ≤ 14·U32 of the value: 16·U32 for mIoU, 2·U32 for the rest.
    for name, value in theirs.items():
        bound = 16 * U32 if name == "miou" else 2 * U32
        assert computed[name] == pytest.approx(float(value), rel=bound, abs=0), name
    assert 0.05 < computed["11.25"] < computed["22.5"] < computed["30"] < 1  # the thresholds split the pixels


def test_miou_is_nan_where_a_class_never_occurs_as_libmtls():
    metric, reference = dense_tasks.MeanIoU(4), SegMetric(4)
    label = torch.tensor([[[0, 1], [2, 2]]]).float()
    logits = torch.nn.functional.one_hot(label.long(), 4).permute(0, 3, 1, 2).float()
    metric.update(logits, label.long())
    reference.update_fun(logits, label)
    assert np.isnan(reference.score_fun()[0]) and torch.isnan(metric.compute())


def count_improvement(base_result, new_result, weight):  # LibMTL/utils.py 48-78 (at the commit above)
    improvement = 0
    count = 0
    for task in list(base_result.keys()):
        improvement += (
            ((-1) ** np.array(weight[task]))
            * (np.array(base_result[task]) - np.array(new_result[task]))
            / np.array(base_result[task])
        ).mean()
        count += 1
    return improvement / count


def test_delta_p_is_libmtls_count_improvement():
    """Per task the mean over its metrics, then over the tasks; LibMTL's weight 1 = higher is better (here: a name
    without an error, a loss or an angle in it), its result a fraction (here a percent)."""
    from multiloss.base.metrics import delta_p

    single = {"val/miou/seg": 0.40, "val/pixel_acc/seg": 0.70, "val/abs_err/depth": 0.60, "val/rel_err/depth": 0.25}
    single |= {"val/mean_angle/normal": 30.0, "val/within_11/normal": 0.20}
    new = {"val/miou/seg": 0.42, "val/pixel_acc/seg": 0.69, "val/abs_err/depth": 0.55, "val/rel_err/depth": 0.27}
    new |= {"val/mean_angle/normal": 31.0, "val/within_11/normal": 0.22}
    tasks = {"seg": ["miou", "pixel_acc"], "depth": ["abs_err", "rel_err"], "normal": ["mean_angle", "within_11"]}
    higher = {"miou": 1, "pixel_acc": 1, "abs_err": 0, "rel_err": 0, "mean_angle": 0, "within_11": 1}
    base = {t: [single[f"val/{m}/{t}"] for m in ms] for t, ms in tasks.items()}
    result = {t: [new[f"val/{m}/{t}"] for m in ms] for t, ms in tasks.items()}
    weight = {t: [higher[m] for m in ms] for t, ms in tasks.items()}
    assert delta_p(new, single, sorted(single)) == pytest.approx(
        100 * count_improvement(base, result, weight), rel=1e-12
    )
    # LibMTL's own example (its docstring): A two metrics, B one.
    example = {"val/acc/A": 96, "val/f1/A": 98, "val/acc/B": 0.2}
    other = {"val/acc/A": 93, "val/f1/A": 99, "val/acc/B": 0.5}
    libmtl = count_improvement({"A": [96, 98], "B": [0.2]}, {"A": [93, 99], "B": [0.5]}, {"A": [1, 1], "B": [1]})
    assert delta_p(other, example, sorted(example)) == pytest.approx(100 * libmtl, rel=1e-12)


@pytest.mark.parametrize("encoder", ["segnet", "resnet"])
def test_the_dense_net_gives_every_task_the_input_size_and_its_encoder_output_is_the_representation(encoder):
    from multiloss.balancers.layer_gramian import LayerGramian
    from multiloss.nets import DenseMultiTaskNet

    net = DenseMultiTaskNet({"segmentation": 13, "depth": 1, "normal": 3}, width=4, depth=3, encoder=encoder)
    recorder = LayerGramian(net, keep_outputs=True)
    out = net(torch.randn(2, 3, 32, 24))
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "segmentation": (2, 13, 32, 24),
        "depth": (2, 1, 32, 24),
        "normal": (2, 3, 32, 24),
    }
    losses = [v.square().mean() for v in out.values()]
    rep, per_task, heads, name = recorder.representation(losses)
    assert {task for _, _, task in heads} == {0, 1, 2}  # each decoder's parameters, its task's gradient
    assert tuple(rep.shape) == (2, 16, 4, 3) and tuple(per_task.shape) == (3, 2, 16, 4, 3)
    assert (
        name == {"segnet": "stages.2", "resnet": "stages.2"}[encoder]
        or rep.shape == net.encode(torch.randn(2, 3, 32, 24))[0].shape
    )


def test_a_task_with_several_metrics_logs_each_and_a_bad_one_is_named_by_key():
    from torchmetrics import MetricCollection

    from multiloss.config import ConfigError
    from multiloss.multitask.tasks import build_tasks

    spec = {"depth": {"loss": "multiloss.multitask.dense.depth_loss", "target": "depth", "metric": {
        "abs_err": {"_target_": "multiloss.multitask.dense.DepthError"},
        "rel_err": {"_target_": "multiloss.multitask.dense.DepthError", "relative": True},
    }}}  # fmt: skip
    task = build_tasks(spec)["depth"]
    assert isinstance(task.metric, MetricCollection) and [n for n, _ in task.logged()] == ["abs_err", "rel_err"]
    spec["depth"]["metric"]["rel_err"] = {"_target_": "torch.nn.L1Loss"}
    with pytest.raises(ConfigError) as err:
        build_tasks(spec)
    assert err.value.key == "tasks.depth.metric.rel_err"


def test_experiment_scenes_trains_on_generated_scenes_with_every_metric_logged(tmp_path):
    """``python -m multiloss.data.scenes`` then ``experiment=scenes data.path=...`` (with the rule on the
    representation): the run logs NYUv2's nine numbers per validation."""
    from multiloss import testing, train
    from multiloss.data import scenes
    from tests.conftest import QUIET

    data = scenes.write(tmp_path / "scenes", train=16, val=8, size=16, seed=0)
    cfg = testing.compose(
        *QUIET,
        "~callbacks.loss_curves",
        "trainer=cpu",
        "experiment=scenes",
        f"data.path={data}",
        "model.net.width=4",
        "model.net.depth=2",
        "trainer.max_epochs=1",
        "balancer=upgrad",
        "model.balancer.rep_grad=batch",
        output_dir=tmp_path / "run",
    )
    metrics = train(cfg)
    names = {"miou/segmentation", "pixel_acc/segmentation", "abs_err/depth", "rel_err/depth"}
    names |= {f"{m}/normal" for m in ("mean_angle", "median_angle", "within_11", "within_22", "within_30")}
    assert {f"val/{n}" for n in names} <= set(metrics)
    assert all(np.isfinite(metrics[f"val/{n}"]) for n in names - {"miou/segmentation"})
