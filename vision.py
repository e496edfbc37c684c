"""Image observations for the visual agents (Appendix C.3: Qwen2.5-VL on Sokoban and EZPoints, skills only at
training time, as for the text agents).

An env in image mode writes `IMAGE` in its actor prompt where an image goes and returns the images from
`env.prompt_images()`. `encode` turns (prompt text, images) into the model's own input: the chat template
renders each image part as `<|vision_start|><|image_pad|><|vision_end|>`, the image processor (the model's
preprocessor_config.json, PIL backend: no torchvision) gives pixel values and the patch grid (t, h, w) of
each image, and each `<|image_pad|>` is repeated t*h*w / merge^2 times, the number of visual tokens the
vision tower emits (the rule of transformers' Qwen2_5_VLProcessor, whose construction needs torchvision's
video processor).

The result is an `ImagePrompt`: the token ids as a plain list that also carries the images (PNG bytes,
lossless and small) and the folder of the processor. It is what `Step.prompt_ids` holds for a visual step,
so the rows of every log-prob pass (old, reference, update, re-scoring) keep their images through the
trainer's batching unchanged, and `pixel_inputs` rebuilds the vision inputs of any batch of rows.
"""
import functools
import io
import json
import os

import numpy as np

from envs import IMAGE   # an image's place in an env's prompt text (the authors' marker)


class ImagePrompt(list):
    """Chat-templated prompt token ids (image placeholders expanded) with `images` (PNG bytes, placeholder
    order) and `source` (the folder whose processor encoded them). Behaves as the list of ids elsewhere."""

    def __init__(self, ids, images, source):
        super().__init__(ids)
        self.images, self.source = list(images), source


def is_visual(path):
    """True when the HF folder holds a vision-language model (its config has a vision tower)."""
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        return False
    with open(cfg) as f:
        return "vision_config" in json.load(f)


class Processor:
    """The model's tokenizer and image processor (PIL backend), and its placeholder rule."""

    def __init__(self, path):
        from transformers import AutoImageProcessor, AutoTokenizer
        if not os.path.exists(os.path.join(path, "preprocessor_config.json")):
            raise SystemExit(f"{path} has no image processor (preprocessor_config.json): image mode (--image) "
                             f"needs a vision-language model such as Qwen/Qwen2.5-VL-3B-Instruct")
        self.source = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.image_token = "<|image_pad|>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.merge = self.image_processor.merge_size

    def pixels(self, images):
        """images (arrays, PIL images or PNG bytes) -> {"pixel_values" [patches, C*t*p*p], "image_grid_thw"
        [images, 3]}."""
        out = self.image_processor(images=[as_pil(x) for x in images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@functools.lru_cache(maxsize=8)
def load_processor(path):
    """The processor of a model folder, loaded once per process."""
    return Processor(path)


def save_image_processor(tokenizer, out):
    """Beside a checkpoint's tokenizer: the image processor of the folder the tokenizer came from, when it has
    one, so that the checkpoint loads as a vision-language model again (resume, evaluation, vLLM)."""
    src = getattr(tokenizer, "name_or_path", "")
    if src and os.path.exists(os.path.join(src, "preprocessor_config.json")):
        load_processor(src).image_processor.save_pretrained(out)


def as_pil(x):
    from PIL import Image
    if isinstance(x, (bytes, bytearray)):
        return Image.open(io.BytesIO(x)).convert("RGB")
    if isinstance(x, np.ndarray):
        return Image.fromarray(x.astype(np.uint8)).convert("RGB")
    return x.convert("RGB")


def to_png(x):
    """An image (uint8 array [H, W, 3], PIL image or PNG bytes) as PNG bytes."""
    if isinstance(x, (bytes, bytearray)):
        return bytes(x)
    buf = io.BytesIO()
    as_pil(x).save(buf, format="PNG")
    return buf.getvalue()


def with_image_parts(messages):
    """Chat messages whose text holds IMAGE markers -> the same messages with content parts
    [{"type": "text"}, {"type": "image"}, ...] (the form vision chat templates read). -> (messages, count)."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    out, count = [], 0
    for m in messages:
        pieces = m["content"].split(IMAGE)
        parts = []
        for k, piece in enumerate(pieces):
            if k:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        count += len(pieces) - 1
        out.append({"role": m["role"], "content": parts})
    return out, count


def encode(proc, messages, images):
    """(a user text or chat messages with IMAGE markers, one image per marker) -> ImagePrompt, generation
    prompt included."""
    msgs, count = with_image_parts(messages)
    if count != len(images):
        raise ValueError(f"the prompt has {count} image marker(s) but {len(images)} image(s) were given")
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    pngs = [to_png(x) for x in images]
    if pngs:
        grid = proc.pixels(pngs)["image_grid_thw"]                              # [images, 3]
        chunks = text.split(proc.image_token)
        if len(chunks) - 1 != len(pngs):
            raise ValueError(f"the chat template wrote {len(chunks) - 1} image placeholders for {len(pngs)} images")
        text = chunks[0] + "".join(proc.image_token * (int(g.prod()) // proc.merge ** 2) + c
                                   for g, c in zip(grid, chunks[1:]))
    ids = proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    return ImagePrompt(ids, pngs, proc.source)


def collapsed(prompt):
    """An ImagePrompt's ids with each image's run of placeholders cut back to one token: the form vLLM's
    multimodal prompts take (its own processor expands each to the same count)."""
    pad = load_processor(prompt.source).image_token_id
    return [t for k, t in enumerate(prompt) if t != pad or k == 0 or prompt[k - 1] != pad]


def images_of(prompts):
    """Every image of a batch of rows, row by row (the order the model's image placeholders expect)."""
    return [im for p in prompts for im in getattr(p, "images", [])]


def pixel_inputs(prompts, device):
    """The vision inputs of a batch of rows (ImagePrompts; plain rows have none) -> {} or {"pixel_values",
    "image_grid_thw"} on `device`."""
    images = images_of(prompts)
    if not images:
        return {}
    source = next(p.source for p in prompts if getattr(p, "images", None))
    out = load_processor(source).pixels(images)
    return {k: v.to(device) for k, v in out.items()}
