"""wav2vec 2.0 base (torchaudio ``wav2vec2_base``, random weights) on 4 waveforms of 64000 samples
(4 s at 16 kHz): the last transformer layer's features, 4x199x768.

Every dropout and the layer drop are 0 (torchaudio's defaults are 0.1): random masks or skipped layers
would make every backend compute another function than eager, and the bench checks each against eager
before timing it.  Its feature extractor is seven Conv1d layers (GroupNorm after the first, GELU after
each), then 12 transformer layers.  Rows: bf16, inference and training.  Needs torchaudio, imported when
the model is built.  The waveforms stay as they are (no memory format applies).
"""

import torch
import torch.nn as nn

DTYPES = ("bf16",)
MODES = ("infer", "train")
REQUIRES = ("torchaudio",)
INFER_EVAL = True

batch_size = 4
samples = 64000


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        from torchaudio.models import wav2vec2_base

        self.net = wav2vec2_base(encoder_projection_dropout=0.0, encoder_attention_dropout=0.0,
                                 encoder_ff_interm_dropout=0.0, encoder_dropout=0.0, encoder_layer_drop=0.0)

    def forward(self, waveforms):
        features, _ = self.net(waveforms)  # the second output is the lengths, None without lengths given
        return features


def get_inputs():
    return [torch.randn(batch_size, samples)]


def get_init_inputs():
    return []
