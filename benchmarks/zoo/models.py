"""The public model zoo: real architectures from Hugging Face ``transformers`` at small random-init
configurations, each with a batch of the task it was built for.

Why ``transformers`` for the CNNs too: it implements MobileNetV2, ResNet, ConvNeXt, RegNet and
EfficientNet in plain torch, so one well-kept library covers five families; timm and torchvision
need torchvision, whose PyPI wheels do not load beside the CPU build of torch this project pins
(``operator torchvision::nms does not exist``). Dropout is off everywhere (the comparison is of
arithmetic, not of random masks); every other setting is the library's default, attention included
(SDPA where the model has it).

Each entry's ``build(seed)`` returns the model in train mode and its batch (keyword arguments, the
labels among them): ``model(**batch).loss`` is the loss the zoo trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "MODELS", "ZooModel"]

Batch = dict[str, torch.Tensor]

FAMILIES = ("CNN", "vision transformer", "decoder LM", "encoder LM", "encoder-decoder")

VOCAB, SEQ, TEXT_BATCH = 256, 32, 4
IMAGE, IMAGE_BATCH, CLASSES = 64, 8, 5
# the small transformer every language model shares: 2 layers, width 64, 4 heads
HIDDEN, LAYERS, HEADS, FFN = 64, 2, 4, 128


@dataclass(frozen=True)
class ZooModel:
    """A model of the zoo: ``build(seed)`` gives it (train mode, seeded init) and its batch."""

    name: str
    family: str
    description: str
    build: Callable[[int], tuple[nn.Module, Batch]]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(seed: int, size: int = IMAGE) -> Batch:
    g = _generator(seed)
    return {"pixel_values": torch.randn(IMAGE_BATCH, 3, size, size, generator=g),
            "labels": torch.randint(0, CLASSES, (IMAGE_BATCH,), generator=g)}


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (TEXT_BATCH, SEQ), generator=_generator(seed))


def _causal_lm(seed: int) -> Batch:
    ids = _tokens(seed)
    return {"input_ids": ids, "labels": ids}


def _classify_text(seed: int) -> Batch:
    return {"input_ids": _tokens(seed),
            "labels": torch.randint(0, CLASSES, (TEXT_BATCH,), generator=_generator(seed + 1))}


def _seq2seq(seed: int) -> Batch:
    return {"input_ids": _tokens(seed), "labels": _tokens(seed + 1)}


def _made(seed: int, make: Callable[[], nn.Module], batch: Batch) -> tuple[nn.Module, Batch]:
    torch.manual_seed(seed)
    model = make()
    labels, config = batch.get("labels"), getattr(model, "config", None)
    if labels is not None and labels.dim() == 1 and getattr(config, "problem_type", "") is None:
        # What a classifier's loss infers from its first labels and writes into the config
        # (transformers.loss.loss_utils), set up front: written during the first step, it fails a
        # guard of Dynamo's, and the model compiles again at its second, with any backend.
        config.problem_type = "single_label_classification"
    return model.train(), batch


def _vision(seed: int, make: Callable[[], nn.Module]) -> tuple[nn.Module, Batch]:
    return _made(seed, make, _images(seed))


def mobilenet_v2(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.MobileNetV2Config(depth_multiplier=0.35, image_size=IMAGE, num_labels=CLASSES,
                              classifier_dropout_prob=0.0)
    return _vision(seed, lambda: T.MobileNetV2ForImageClassification(cfg))


def resnet(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                         layer_type="bottleneck", num_labels=CLASSES)
    return _vision(seed, lambda: T.ResNetForImageClassification(cfg))


def convnext(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=CLASSES,
                           drop_path_rate=0.0)
    return _vision(seed, lambda: T.ConvNextForImageClassification(cfg))


def regnet(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1],
                         groups_width=8, num_labels=CLASSES)
    return _vision(seed, lambda: T.RegNetForImageClassification(cfg))


def efficientnet(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    # hidden_dim is the head's width after width_coefficient (1280 x 0.25): the library does not
    # scale it itself, and its default (2560, B7's) does not fit a narrower network
    cfg = T.EfficientNetConfig(image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                               num_labels=CLASSES, dropout_rate=0.0, drop_connect_rate=0.0)
    return _vision(seed, lambda: _unit_norm_scales(T.EfficientNetForImageClassification(cfg)))


def _unit_norm_scales(model: nn.Module) -> nn.Module:
    """Batch norms' scales set to 1, as torchvision and most libraries start them. transformers'
    EfficientNet draws them like its weights, from N(0, 0.02): each of its ~20 batch norms then
    shrinks the features fifty-fold, so at initialization the classifier reads zeros, and every
    gradient but the head's is 0 or ~1e-10 in float32 (a first step that tests nothing)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
    return model


def vit(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, intermediate_size=FFN, num_labels=CLASSES,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _vision(seed, lambda: T.ViTForImageClassification(cfg))


def gpt2(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
                       bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _made(seed, lambda: T.GPT2LMHeadModel(cfg), _causal_lm(seed))


def _llama_like(cls: str, config: str, *, kv_heads: int = 2, tied: bool = False, attention: str = "sdpa"
                ) -> Callable[[int], tuple[nn.Module, Batch]]:
    """A Llama-style decoder: ``kv_heads`` key-value heads (grouped-query attention; 1: multi-query),
    embeddings tied to the LM head or not, and transformers' ``attention`` implementation."""
    def build(seed: int) -> tuple[nn.Module, Batch]:
        import transformers as T

        cfg = getattr(T, config)(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
                                 num_attention_heads=HEADS, num_key_value_heads=kv_heads, vocab_size=VOCAB,
                                 max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                 tie_word_embeddings=tied)
        model, batch = _made(seed, lambda: getattr(T, cls)(cfg), _causal_lm(seed))
        model.set_attn_implementation(attention)
        return model, batch

    return build


def bert(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.BertConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                       intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=CLASSES,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _made(seed, lambda: T.BertForSequenceClassification(cfg), _classify_text(seed))


def distilbert(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.DistilBertConfig(n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, hidden_dim=FFN, vocab_size=VOCAB,
                             max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
                             seq_classif_dropout=0.0)
    ids = _tokens(seed)
    return _made(seed, lambda: T.DistilBertForMaskedLM(cfg), {"input_ids": ids, "labels": ids})


def t5(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.T5Config(num_layers=LAYERS, num_decoder_layers=LAYERS, d_model=HIDDEN, d_ff=FFN, d_kv=HIDDEN // HEADS,
                     num_heads=HEADS, vocab_size=VOCAB, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return _made(seed, lambda: T.T5ForConditionalGeneration(cfg), _seq2seq(seed))


def bart(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    cfg = T.BartConfig(encoder_layers=LAYERS, decoder_layers=LAYERS, d_model=HIDDEN, encoder_attention_heads=HEADS,
                       decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB,
                       max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                       forced_eos_token_id=None)
    return _made(seed, lambda: T.BartForConditionalGeneration(cfg), _seq2seq(seed))


def whisper(seed: int) -> tuple[nn.Module, Batch]:
    import transformers as T

    mel, frames = 16, 64  # the encoder's two convolutions halve the frames: 32 positions
    cfg = T.WhisperConfig(num_mel_bins=mel, encoder_layers=LAYERS, decoder_layers=LAYERS, d_model=HIDDEN,
                          encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                          decoder_ffn_dim=FFN, vocab_size=VOCAB, max_source_positions=frames // 2,
                          max_target_positions=SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                          pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                          begin_suppress_tokens=None, suppress_tokens=None)
    g = _generator(seed)
    batch = {"input_features": torch.randn(TEXT_BATCH, mel, frames, generator=g), "labels": _tokens(seed + 1)}
    return _made(seed, lambda: T.WhisperForConditionalGeneration(cfg), batch)


def _entries() -> list[ZooModel]:
    def m(name: str, family: str, description: str, build: Callable[[int], Any]) -> ZooModel:
        return ZooModel(name, family, description, build)

    return [
        m("mobilenet_v2", "CNN", "MobileNetV2 x0.35: depthwise convolutions, BatchNorm, ReLU6", mobilenet_v2),
        m("resnet", "CNN", "ResNet, bottleneck blocks, BatchNorm", resnet),
        m("convnext", "CNN", "ConvNeXt: 7x7 depthwise convolutions, LayerNorm, GELU, layer scale", convnext),
        m("regnet", "CNN", "RegNet: grouped convolutions, squeeze-and-excitation", regnet),
        m("efficientnet", "CNN", "EfficientNet x0.25: depthwise convolutions, SiLU, squeeze-and-excitation",
          efficientnet),
        m("vit", "vision transformer", "ViT, 8x8 patches", vit),
        m("gpt2", "decoder LM", "GPT-2: tied embeddings, Conv1D projections", gpt2),
        m("llama", "decoder LM", "Llama: RMSNorm, rotary, SwiGLU, grouped-query attention",
          _llama_like("LlamaForCausalLM", "LlamaConfig")),
        m("llama_mqa", "decoder LM", "Llama with multi-query attention (one key-value head), tied embeddings",
          _llama_like("LlamaForCausalLM", "LlamaConfig", kv_heads=1, tied=True)),
        m("llama_eager", "decoder LM", "Llama, grouped-query attention written out (attn_implementation='eager')",
          _llama_like("LlamaForCausalLM", "LlamaConfig", attention="eager")),
        m("mistral", "decoder LM", "Mistral: Llama-style with sliding-window attention",
          _llama_like("MistralForCausalLM", "MistralConfig")),
        m("qwen2", "decoder LM", "Qwen2: Llama-style with biased QKV projections",
          _llama_like("Qwen2ForCausalLM", "Qwen2Config")),
        m("bert", "encoder LM", "BERT, sequence classification", bert),
        m("distilbert", "encoder LM", "DistilBERT, masked LM", distilbert),
        m("t5", "encoder-decoder", "T5 v1.1: gated GELU, RMS norm, relative position buckets", t5),
        m("bart", "encoder-decoder", "BART", bart),
        m("whisper", "encoder-decoder", "Whisper: convolutional audio encoder, text decoder", whisper),
    ]


MODELS: dict[str, ZooModel] = {m.name: m for m in _entries()}
