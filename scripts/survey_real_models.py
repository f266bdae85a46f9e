"""How much real vision code ``batchlayers.stack`` converts exactly: timm and torchvision models built from
small configurations (nothing downloaded), each stacked from two models with their own weights and compared
with the two originals by :func:`batchlayers.verify` in float64 (outputs and the gradients of every parameter
and of the input).

    python scripts/survey_real_models.py                # every model, a markdown table on stdout
    python scripts/survey_real_models.py tm.xcit tv.vit  # some of them
    python scripts/survey_real_models.py --model-by-model   # stacked with execution="model_by_model"

It needs timm and torchvision, which are not test dependencies: PyPI's torchvision does not import beside the
CPU build of torch 2.13 that CI uses. A separate environment that has both, e.g.::

    python -m venv /tmp/vision && /tmp/vision/bin/pip install torch==2.14.1 torchvision==0.29.1 timm
    /tmp/vision/bin/pip install --no-deps -e . && /tmp/vision/bin/python scripts/survey_real_models.py

Each model is checked in eval mode (batch 3) and in train mode (batch 8, so that BatchNorm's batch statistics
are not computed from a handful of values; dropout and stochastic depth are set to 0). A result is:

- ``exact``: every output and gradient within float64 tolerances (``verify``'s: rtol 1e-7, atol 1e-7).
- ``refused``: ``stack`` or the stacked forward raised a ``ValueError``/``TypeError`` of batchlayers'.
- ``error``: anything else raised (a bug, or a model that does not run at that size).
- ``ill-conditioned``: outside tolerance, but the original model itself moves by at least a tenth as much
  from rounding alone (its input changed by one part in 1e15, or its batch reversed: BatchNorm over a
  near-constant channel amplifies rounding): no verdict.
- ``WRONG``: outside tolerance for no such reason. A silent wrong result: the worst bug batchlayers can have.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import batchlayers as bl

M = 2


def _cases() -> dict[str, tuple[Callable[[], nn.Module], int | tuple[int, ...]]]:
    """name -> (a model factory, image size or one sample's input shape). ``tv.``: torchvision, ``tm.``: timm."""
    import timm
    import torchvision.models as tvm
    from timm.models import mlp_mixer
    from torchvision.models.convnext import CNBlockConfig
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large, lraspp_mobilenet_v3_large

    def tv(name: str, **kw) -> Callable[[], nn.Module]:
        return lambda: getattr(tvm, name)(weights=None, num_classes=3, **kw)

    def tm(name: str, **kw) -> Callable[[], nn.Module]:
        return lambda: timm.create_model(name, pretrained=False, num_classes=3, **kw)

    small_vit = dict(img_size=32, patch_size=8, depth=2)
    return {
        "tv.resnet18": (tv("resnet18"), 32),
        "tv.resnext": (lambda: tvm.ResNet(tvm.resnet.Bottleneck, [1, 1, 1, 1], num_classes=3, groups=4,
                                          width_per_group=8), 32),
        "tv.wide_resnet": (lambda: tvm.ResNet(tvm.resnet.Bottleneck, [1, 1, 1, 1], num_classes=3,
                                              width_per_group=128), 32),
        "tv.mobilenet_v2": (tv("mobilenet_v2", width_mult=0.25), 32),
        "tv.mobilenet_v3_small": (tv("mobilenet_v3_small", width_mult=0.25), 32),
        "tv.mobilenet_v3_large": (tv("mobilenet_v3_large", width_mult=0.25), 32),
        "tv.efficientnet_b0": (tv("efficientnet_b0"), 32),
        "tv.efficientnet_v2_s": (tv("efficientnet_v2_s"), 32),
        "tv.shufflenet_v2": (tv("shufflenet_v2_x0_5"), 32),
        "tv.squeezenet": (tv("squeezenet1_1"), 64),
        "tv.densenet": (lambda: tvm.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8,
                                             num_classes=3), 32),
        "tv.regnet_y": (tv("regnet_y_400mf"), 32),
        "tv.regnet_x": (tv("regnet_x_400mf"), 32),
        "tv.mnasnet": (tv("mnasnet0_5"), 32),
        "tv.googlenet": (tv("googlenet", aux_logits=False, init_weights=True), 64),
        "tv.inception_v3": (tv("inception_v3", aux_logits=False, init_weights=True), 80),
        "tv.alexnet": (tv("alexnet"), 64),
        "tv.vgg11_bn": (tv("vgg11_bn"), 32),
        "tv.convnext": (lambda: tvm.ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)],
                                             num_classes=3), 32),
        "tv.vit": (lambda: tvm.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=16, mlp_dim=32, num_classes=3), 32),
        "tv.swin": (lambda: tvm.SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                                                window_size=[2, 2], num_classes=3), 32),
        "tv.swin_v2": (lambda: tvm.SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                                                   window_size=[2, 2], num_classes=3,
                                                   block=tvm.swin_transformer.SwinTransformerBlockV2,
                                                   downsample_layer=tvm.swin_transformer.PatchMergingV2), 32),
        "tv.maxvit": (lambda: tvm.MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2,
                                         block_channels=[8, 16], block_layers=[1, 1], head_dim=4,
                                         stochastic_depth_prob=0.0, num_classes=3), 32),
        "tv.lraspp": (lambda: lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3), 64),
        "tm.resnet18": (tm("resnet18"), 32),
        "tm.resnet26d": (tm("resnet26d"), 32),
        "tm.seresnext26d": (tm("seresnext26d_32x4d"), 32),
        "tm.ecaresnet26t": (tm("ecaresnet26t"), 32),
        "tm.resnetv2_bit": (tm("resnetv2_50x1_bit"), 32),
        "tm.resnest14d": (tm("resnest14d"), 32),
        "tm.res2net": (tm("res2net50_14w_8s"), 32),
        "tm.skresnet18": (tm("skresnet18"), 32),
        "tm.cspresnet50": (tm("cspresnet50"), 32),
        "tm.cspdarknet53": (tm("cspdarknet53"), 32),
        "tm.dla34": (tm("dla34"), 32),
        "tm.dpn68": (tm("dpn68"), 32),
        "tm.densenet121": (tm("densenet121"), 32),
        "tm.regnetx_002": (tm("regnetx_002"), 32),
        "tm.regnetz_b16": (tm("regnetz_b16"), 32),
        "tm.rexnet": (tm("rexnet_100"), 32),
        "tm.efficientnet_b0": (tm("efficientnet_b0"), 32),
        "tm.tf_efficientnet_b0": (tm("tf_efficientnet_b0"), 32),
        "tm.mixnet_s": (tm("mixnet_s"), 32),
        "tm.mobilenetv3_small": (tm("mobilenetv3_small_050"), 32),
        "tm.mobileone_s0": (tm("mobileone_s0"), 32),
        "tm.ghostnet": (tm("ghostnet_050"), 32),
        "tm.lcnet": (tm("lcnet_050"), 32),
        "tm.tinynet": (tm("tinynet_e"), 32),
        "tm.vovnet": (tm("ese_vovnet19b_dw"), 32),
        "tm.repvgg": (tm("repvgg_a0"), 32),
        "tm.nfnet": (tm("nfnet_l0"), 32),
        "tm.hrnet": (tm("hrnet_w18_small"), 64),
        "tm.xception41": (tm("xception41"), 64),
        "tm.inception_v3": (tm("inception_v3"), 96),
        "tm.convmixer": (tm("convmixer_768_32"), 32),
        "tm.convnext_atto": (tm("convnext_atto"), 32),
        "tm.poolformer": (tm("poolformer_s12"), 32),
        "tm.convformer": (tm("convformer_s18"), 64),
        "tm.edgenext": (tm("edgenext_xx_small"), 64),
        "tm.fastvit": (tm("fastvit_t8"), 64),
        "tm.repvit": (tm("repvit_m0_9"), 64),
        "tm.mobilevit": (tm("mobilevit_xxs"), 64),
        "tm.mobilevitv2": (tm("mobilevitv2_050"), 64),
        "tm.efficientvit": (tm("efficientvit_b0"), 64),
        "tm.efficientformer": (tm("efficientformer_l1"), 224),
        "tm.efficientformerv2": (tm("efficientformerv2_s0"), 224),
        "tm.levit": (tm("levit_128s", img_size=64), 64),
        "tm.vit": (tm("vit_tiny_patch16_224", **small_vit), 32),
        "tm.vit_registers": (tm("vit_small_patch16_224", reg_tokens=2, no_embed_class=True, **small_vit), 32),
        "tm.deit_distilled": (tm("deit_tiny_distilled_patch16_224", **small_vit), 32),
        "tm.beit": (tm("beit_base_patch16_224", embed_dim=16, num_heads=2, **small_vit), 32),
        "tm.eva02": (tm("eva02_tiny_patch14_224", img_size=28, patch_size=14, depth=2), 28),
        "tm.cait": (tm("cait_xxs24_224", **small_vit), 32),
        "tm.xcit": (tm("xcit_nano_12_p16_224", **small_vit), 32),
        "tm.convit": (tm("convit_tiny", **small_vit), 32),
        "tm.crossvit": (tm("crossvit_tiny_240"), 240),
        "tm.pit": (tm("pit_ti_224", img_size=64), 64),
        "tm.twins": (tm("twins_pcpvt_small", img_size=64), 64),
        "tm.pvt_v2": (tm("pvt_v2_b0"), 64),
        "tm.swin": (tm("swin_tiny_patch4_window7_224", img_size=32, window_size=2, embed_dim=16, depths=(1, 1),
                       num_heads=(1, 2)), 32),
        "tm.maxvit": (tm("maxvit_tiny_rw_224", img_size=64), 64),
        "tm.coat": (tm("coat_lite_tiny", img_size=64), 64),
        "tm.gcvit": (tm("gcvit_xxtiny", img_size=64), 64),
        "tm.davit": (tm("davit_tiny"), 64),
        "tm.focalnet": (tm("focalnet_tiny_srf"), 64),
        "tm.mvitv2": (tm("mvitv2_tiny", img_size=64), 64),
        "tm.hiera": (tm("hiera_tiny_224", img_size=64), 64),
        "tm.tiny_vit": (tm("tiny_vit_5m_224"), 224),
        "tm.sequencer": (tm("sequencer2d_s"), 64),
        # found by a broader sweep (one or two models per timm module); the first three needed new rules
        "tm.halonet": (tm("halonet26t"), 256),
        "tm.tnt": (tm("tnt_s_patch16_224", img_size=64, depth=2), 64),
        "tm.volo": (tm("volo_d1_224", img_size=64), 64),
        "tm.botnet": (tm("botnet26t_256", img_size=64), 64),
        "tm.lambda_resnet": (tm("lambda_resnet26t", img_size=64), 64),
        "tm.nest": (tm("nest_tiny", img_size=64), 64),
        "tm.swinv2_cr": (tm("swinv2_cr_tiny_ns_224", img_size=64), 64),
        "tm.samvit": (tm("samvit_base_patch16", img_size=64, depth=2), 64),
        "tm.vit_relpos": (tm("vit_relpos_small_patch16_224", img_size=64, depth=2), 64),
        "tm.vit_rope": (tm("vit_betwixt_patch16_rope_reg4_gap_256", img_size=64, depth=2), 64),
        "tm.siglip": (tm("vit_base_patch16_siglip_224", img_size=64, depth=2), 64),
        "tm.vitamin": (tm("vitamin_small_224", img_size=64, depth=2), 64),
        "tm.coatnet": (tm("coatnet_0_rw_224", img_size=64), 64),
        "tm.maxxvit": (tm("maxxvit_rmlp_nano_rw_256", img_size=64), 64),
        "tm.mambaout": (tm("mambaout_femto"), 64),
        "tm.inception_next": (tm("inception_next_atto"), 64),
        "tm.nextvit": (tm("nextvit_small"), 64),
        "tm.convnextv2": (tm("convnextv2_atto"), 64),
        "tm.mobilenetv4_hybrid": (tm("mobilenetv4_hybrid_medium"), 64),
        "tm.efficientvim": (tm("efficientvim_m1"), 64),
        "tm.fasternet": (tm("fasternet_t0"), 64),
        "tm.starnet": (tm("starnet_s050"), 64),
        "tm.swiftformer": (tm("swiftformer_xs", img_size=64), 64),
        "tm.visformer": (tm("visformer_tiny", img_size=64, depth=2), 64),
        "tm.hgnetv2": (tm("hgnetv2_b0"), 64),
        "tm.shvit": (tm("shvit_s1"), 64),
        "tm.tresnet": (tm("tresnet_m"), 64),
        "tv.deeplabv3": (lambda: deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3),
                         64),
        "tv.r3d_18": (lambda: tvm.video.r3d_18(weights=None, num_classes=3), (3, 4, 32, 32)),
        "tm.mixer": (lambda: mlp_mixer.MlpMixer(num_classes=3, img_size=32, patch_size=8, num_blocks=2,
                                                embed_dim=16), 32),
        "tm.resmlp": (lambda: mlp_mixer.MlpMixer(num_classes=3, img_size=32, patch_size=8, num_blocks=2, embed_dim=16,
                                                 mlp_ratio=4, block_layer=mlp_mixer.ResBlock,
                                                 norm_layer=mlp_mixer.Affine), 32),
        "tm.gmlp": (lambda: mlp_mixer.MlpMixer(num_classes=3, img_size=32, patch_size=8, num_blocks=2, embed_dim=16,
                                               mlp_ratio=6, block_layer=mlp_mixer.SpatialGatingBlock,
                                               mlp_layer=mlp_mixer.GatedMlp), 32),
    }  # fmt: skip


def _no_randomness(model: nn.Module) -> nn.Module:
    """Dropout and stochastic depth off: each model would draw its own random numbers."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name in ("drop_prob", "p"):  # timm's DropPath, torchvision's StochasticDepth
            if type(module).__name__ in ("DropPath", "StochasticDepth") and hasattr(module, name):
                setattr(module, name, 0.0)
    return model


def _distinct_statistics(models: list[nn.Module]) -> None:
    """Each model's BatchNorm running statistics its own (fresh models all hold 0 and 1)."""
    for i, model in enumerate(models):
        generator = torch.Generator().manual_seed(100 + i)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                mean, var = module.running_mean, module.running_var
                mean.copy_(torch.randn(mean.shape, generator=generator, dtype=mean.dtype) * 0.1)
                var.copy_(torch.rand(var.shape, generator=generator, dtype=var.dtype) + 0.5)


def _sensitivity(model: nn.Module, x: torch.Tensor) -> float:
    """How much the model's output moves from rounding alone: its input changed by one part in 1e15, or its
    batch in the reverse order (BatchNorm then sums its statistics in another order), whichever moves it more."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        a, b, c = model(x), twin(x * (1 + 1e-15)), copy.deepcopy(model)(x.flip(0))
    a, b, c = (a["out"], b["out"], c["out"]) if isinstance(a, dict) else (a, b, c)
    return max((a - b).abs().max().item(), (a - c.flip(0)).abs().max().item())


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:160]


def _check(models: list[nn.Module], stacked: nn.Module, size: int | tuple[int, ...], train: bool) -> str:
    for model in (*models, stacked):
        model.train(train)
    batch = 8 if train else 3
    shape = (3, size, size) if isinstance(size, int) else size
    x = torch.randn(M, batch, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    try:
        result = bl.verify(models, stacked, x)
    except (ValueError, TypeError) as exc:
        if "batchlayers" in str(exc) or "stacked" in str(exc):
            return f"refused: {_first_line(exc)}"
        return f"error: {type(exc).__name__}: {_first_line(exc)}"
    except Exception as exc:
        return f"error: {type(exc).__name__}: {_first_line(exc)}"
    largest = max(result.outputs.max().item(), result.gradients.max().item())
    if bool(result.passed.all()):
        return f"exact ({largest:.0e})"
    moved = _sensitivity(models[0], x[0])
    if moved >= 0.1 * result.outputs.max().item():
        return f"ill-conditioned ({largest:.0e}; the original alone moves {moved:.0e})"
    return f"WRONG ({largest:.0e} at {result.worst_output[0]} / {result.worst_gradient[0]})"


def main(names: list[str]) -> None:
    execution = "model_by_model" if "--model-by-model" in names else "batched"
    names = [n for n in names if n != "--model-by-model"]
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cases = _cases()
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(cases)}")
    import timm
    import torchvision

    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, timm {timm.__version__}, "
          f"M={M}, float64, execution={execution!r}\n")  # fmt: skip
    print("| model | eval | train | s |\n|---|---|---|---|")
    for name, (make, size) in cases.items():
        if names and name not in names:
            continue
        start = time.perf_counter()
        models = []
        try:
            for i in range(M):
                torch.manual_seed(i)
                models.append(_no_randomness(make()).double())
        except Exception as exc:  # a configuration this version of the library does not take
            print(f"| {name} | not built: {type(exc).__name__}: {_first_line(exc)} | | |", flush=True)
            continue
        with torch.no_grad():
            _distinct_statistics(models)
        try:
            stacked = bl.stack(models, execution=execution)
        except (ValueError, TypeError) as exc:
            verdict = f"refused by stack: {_first_line(exc)}"
            print(f"| {name} | {verdict} | | {time.perf_counter() - start:.1f} |", flush=True)
            continue
        eval_result = _check(models, stacked, size, train=False)
        train_result = _check(models, stacked, size, train=True)
        print(f"| {name} | {eval_result} | {train_result} | {time.perf_counter() - start:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
