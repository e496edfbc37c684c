"""A tiny Qwen2.5-VL built here for the visual tests (Appendix C.3's backbone family, random weights, no
download): the embedded SmolLM2 tokenizer plus Qwen2-VL's vision special tokens, a ChatML template that
places `<|vision_start|><|image_pad|><|vision_end|>` for each image part, the PIL image processor (no
torchvision), and a config of hidden 64, 2 text layers and one vision block. Saved as an HF folder that
transformers and vLLM load like the real Qwen/Qwen2.5-VL-3B-Instruct."""
import os

import torch

import rollout

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# ChatML with image parts, as Qwen2-VL's own template renders them (no default system message)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(out, seed=0, max_pixels=112 * 112, head_dim=16):
    """Write the tiny model's folder to `out` (once) and return it. `max_pixels` keeps images to a few
    visual tokens (a 112x112 image -> 8x8 patches of 14 px -> 16 tokens after the 2x2 merge). head_dim:
    16 on the CPU; 64 for vLLM's GPU backends (FlashAttention and Triton need a head size of 32 or more)."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tok = AutoTokenizer.from_pretrained(rollout.resolve_model(rollout.EMBEDDED))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    H = 4 * head_dim                                                   # 4 heads (2 key/value heads)
    m = head_dim // 8                                                  # mrope sections sum to head_dim / 2
    text = dict(vocab_size=len(tok), hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [m, m + m // 2, m + m // 2]},
                tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(depth=1, hidden_size=2 * head_dim, intermediate_size=4 * head_dim, num_heads=2, out_hidden_size=H,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[0], in_channels=3)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float()
    model.generation_config.eos_token_id = tok.eos_token_id
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels).save_pretrained(tmp)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out
