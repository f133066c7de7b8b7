"""The generate request: the model's greedy answer to one question about one image,
token by token (``vlm-readout generate``, the Answer tab's Generate;
:func:`core.generate.generate`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import Cancel, Progress, Request, register_request

if TYPE_CHECKING:
    from PIL import Image

    from core.generate import Generation


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the image is pixels
class GenerateRequest(Request):
    """Generate the answer to ``question`` about ``image`` (``image_path``: the file it was
    read from, None for pixels without one). Generation starts after the bare prompt, so
    there is no answer token to read at and no target.

    Attributes:
        max_new_tokens: the most tokens (None: the model folder's generation config, else 32).
        stop_strings: stop once the answer holds one of them.
        top_k: the alternatives recorded per token.
        raw_prompt: the question may hold the model's special tokens.
        use_cache: decode through the key / value cache (False: re-run the whole sequence each step).
    """

    name: ClassVar[str] = "generate"

    image: Image.Image
    question: str
    image_path: str | None = None
    max_new_tokens: int | None = None
    stop_strings: tuple[str, ...] = ()
    top_k: int = 5
    raw_prompt: bool = False
    use_cache: bool = True

    def parameters(self) -> dict[str, Any]:
        """As :meth:`core.generate.Generation.parameters` names them; ``max_new_tokens`` only
        when asked (the result records the count the model folder gave otherwise)."""
        asked = {} if self.max_new_tokens is None else {"max_new_tokens": self.max_new_tokens}
        return {
            "question": self.question,
            **asked,
            "stop_strings": list(self.stop_strings),
            "top_k": self.top_k,
            "raw_prompt": self.raw_prompt,
            "cache": self.use_cache,
        }

    def document(self, result, loaded) -> dict[str, Any]:
        """The generation's JSON, its ``input`` naming the image too (path, SHA-256, size)."""
        from core.files.images import image_sha256

        doc = result.to_dict()
        path = None if self.image_path is None else str(self.image_path)
        doc["input"].update(image=path, image_sha256=image_sha256(self.image), image_size=list(self.image.size))
        return doc

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> Generation:
        """:func:`core.generate.generate`, cancellable between tokens (the tokens so far are kept)."""
        from core.generate import generate

        return generate(
            loaded,
            self.image,
            self.question,
            max_new_tokens=self.max_new_tokens,
            stop_strings=self.stop_strings,
            top_k=self.top_k,
            raw_prompt=self.raw_prompt,
            use_cache=self.use_cache,
            progress=progress,
            cancel=cancel,
        )
