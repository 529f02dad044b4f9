"""semkv: long-context LLM inference with semantic KV-cache selection."""
from semkv.errors import SemkvError
from semkv.llm import LLM, GenerationOutput
from semkv.methods import METHODS, KVMethod, get_method

__all__ = ["LLM", "GenerationOutput", "METHODS", "KVMethod", "SemkvError", "get_method"]
__version__ = "0.1.0"
