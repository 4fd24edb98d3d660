"""sglang-ssd: Speculative Speculative Decoding (Saguaro) for SGLang."""

__version__ = "0.1.0"
