"""The Stable Diffusion VAE's decoder (diffusers ``AutoencoderKL`` in SD's configuration, random weights)
on a channels-last 1x4x64x64 latent: ``vae.decode(z).sample``, the 1x3x512x512 image.

Configuration: block_out_channels (128, 256, 512, 512), layers_per_block 2, latent_channels 4,
norm_num_groups 32, SiLU, in and out channels 3.  ``forward`` runs what ``AutoencoderKL.decode`` runs,
``post_quant_conv`` then the decoder (GroupNorm + SiLU + Conv2d resnet blocks, a mid-block attention,
nearest-neighbour upsampling); the encoder is dropped after the VAE is built.  Rows: fp32 and bf16,
inference and training.  Needs diffusers, imported when the model is built.
"""

import torch
import torch.nn as nn

DTYPES = ("fp32", "bf16")
MODES = ("infer", "train")
REQUIRES = ("diffusers",)
INFER_EVAL = True

batch_size = 1
latent_channels, latent_size = 4, 64

#: Stable Diffusion's VAE (``AutoencoderKL`` arguments).
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    act_fn="silu",
    latent_channels=latent_channels,
    norm_num_groups=32,
    sample_size=512,
)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        from diffusers import AutoencoderKL

        vae = AutoencoderKL(**VAE_CONFIG)
        self.post_quant_conv = vae.post_quant_conv
        self.decoder = vae.decoder
        self.to(memory_format=torch.channels_last)

    def forward(self, z):
        return self.decoder(self.post_quant_conv(z))


def get_inputs():
    z = torch.randn(batch_size, latent_channels, latent_size, latent_size)
    return [z.to(memory_format=torch.channels_last)]


def get_init_inputs():
    return []
