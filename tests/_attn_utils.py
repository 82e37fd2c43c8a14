# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the attention-backend tests."""

import torch


def model_with(impl) -> torch.nn.Module:
    """A module tree whose one attention layer (``layers.0.attn``) runs ``impl``."""
    layer = torch.nn.Module()
    layer.impl = impl
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].attn = layer
    return model
