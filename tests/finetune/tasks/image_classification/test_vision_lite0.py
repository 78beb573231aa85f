"""The shipped EfficientNet-Lite0 weights, mapped to timm, compute what the original implementation computes.

Reference: ``efficientnet_pytorch`` (the key layout the package ships). Its 0.7.1 release knows no Lite models, so
the reference is built as the Lite variant of its own classes: the Lite0 block strings (EfficientNet-B0's without
squeeze-excitation; tensorflow/tpu efficientnet/lite/efficientnet_lite_builder.py), width and depth 1.0 (so the
fixed stem and head of Lite change nothing), BatchNorm eps 1e-3, and ReLU6 in place of every swish.
"""

import pytest
import torch
from torch import nn

from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.tasks.image_classification import efficientnet_lite as lite
from hf_gpu_train.finetune.tasks.image_classification.model import load_vision_model

LITE0_BLOCKS = ["r1_k3_s11_e1_i32_o16", "r2_k3_s22_e6_i16_o24", "r2_k5_s22_e6_i24_o40", "r3_k3_s22_e6_i40_o80",
                "r3_k5_s11_e6_i80_o112", "r4_k5_s22_e6_i112_o192", "r1_k3_s11_e6_i192_o320"]
# fp32 logits of magnitude ~10 through 18 layers: the two implementations run the same ops in the same order
# (measured difference 0.0); 1e-4 leaves room for a different BLAS kernel choice, and nothing for a wrong weight.
ATOL = 1e-4


def state_dict():
    return torch.load(lite.weights_file(), map_location="cpu", weights_only=True)


def vision_model(cfg, labels):
    return load_vision_model(cfg.model, cfg.options, labels)


@pytest.fixture(scope="module")
def reference():
    efficientnet_pytorch = pytest.importorskip("efficientnet_pytorch", reason="the reference implementation (dev extra)")
    from efficientnet_pytorch.utils import BlockDecoder, efficientnet

    _, params = efficientnet(width_coefficient=1.0, depth_coefficient=1.0, image_size=None, dropout_rate=0.2)
    model = efficientnet_pytorch.EfficientNet(BlockDecoder.decode(LITE0_BLOCKS), params)
    for module in (model, *model._blocks):
        module._swish = nn.ReLU6()
    model.load_state_dict(state_dict(), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def converted():
    return lite.create_model(lite.IMAGENET_CLASSES, pretrained=True).eval()


@pytest.mark.parametrize("size", [224, 97, 64])
def test_converted_logits_equal_the_original_implementation(reference, converted, size):
    torch.manual_seed(size)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected, actual = reference(x), converted(x)
    assert expected.abs().max() > 1  # real weights, not an all-zero head
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_timm_efficientnet_lite0_is_not_the_architecture_of_these_weights(reference):
    """Why tf_efficientnet_lite0: timm's efficientnet_lite0 pads symmetrically and uses BatchNorm eps 1e-5."""
    import timm

    other = timm.create_model("efficientnet_lite0")
    other.load_state_dict(lite.timm_state_dict(state_dict(), other), strict=True)  # same keys and shapes ...
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (other.eval()(x) - reference(x)).abs().max() > 0.1  # ... other numbers


def test_it_sees_real_photographs(converted):
    """scikit-learn's two sample photos, through the preprocessing timm derives from the model's pretrained_cfg."""
    import timm.data
    from PIL import Image
    from sklearn.datasets import load_sample_images

    config = timm.data.resolve_data_config({}, model=converted)
    assert config["mean"] == pytest.approx((127 / 255,) * 3) and config["std"] == pytest.approx((128 / 255,) * 3)
    assert config["input_size"] == (3, 224, 224) and config["interpolation"] == "bicubic" and config["crop_pct"] == 0.875
    transform = timm.data.create_transform(**config)
    photos = [Image.fromarray(array) for array in load_sample_images().images]  # china.jpg (a temple), flower.jpg
    with torch.no_grad():
        top = converted(torch.stack([transform(p) for p in photos])).softmax(-1).topk(3)
    names = timm.data.ImageNetInfo()
    labels = [[names.index_to_description(i) for i in row.tolist()] for row in top.indices]
    assert labels[0][0] == "palace" and "monastery" in labels[0]
    assert labels[1][0] == "daisy"


def test_unknown_keys_are_named():
    import timm

    model = timm.create_model(lite.TIMM_NAME)
    with pytest.raises(ValueError, match="_blocks.0._se_reduce.weight: no _se_reduce"):
        lite.timm_state_dict({"_blocks.0._se_reduce.weight": torch.zeros(1)}, model)
    with pytest.raises(ValueError, match="_blocks.16._bn0.weight: the timm model has 16 blocks"):
        lite.timm_state_dict({"_blocks.16._bn0.weight": torch.zeros(1)}, model)


def test_the_builtin_model_keeps_the_backbone_and_gets_a_head_for_your_classes():
    model = vision_model(load_config(None, ["task=image-classification", "model=builtin:efficientnet_lite0"]), list("abc")).model
    source = state_dict()
    assert torch.equal(model.conv_stem.weight, source["_conv_stem.weight"])
    assert torch.equal(model.blocks[6][0].conv_pwl.weight, source["_blocks.15._project_conv.weight"])
    assert model.classifier.out_features == 3
    scratch = vision_model(load_config(None, ["task=image-classification", "model=builtin:efficientnet_lite0", "pretrained=false"]),
                                list("abc")).model
    assert not torch.equal(scratch.conv_stem.weight, source["_conv_stem.weight"])
