"""The models this gateway serves: name -> tokenizer, config, context length."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from llmbus.model.config import ModelConfig
from llmbus.model.tokenizer import Tokenizer
from services.gateway.config import ModelSpec
from services.gateway.errors import APIError


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int  # prompt + completion tokens never exceed this
    created: int  # unix seconds when loaded

    @classmethod
    def load(cls, spec: ModelSpec) -> "ServedModel":
        path = Path(spec.path)
        if not path.is_dir():
            raise FileNotFoundError(f"model {spec.name!r}: directory not found: {path}")
        config = ModelConfig.from_file(path / "config.json")
        tokenizer = Tokenizer.from_dir(path)
        # like the engine's: an override shortens the model's context, never lengthens it
        limit = min(spec.max_model_len or config.max_model_len, config.max_model_len)
        return cls(spec.name, path, config, tokenizer, limit, int(time.time()))

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "llmbus",
                "max_model_len": self.max_model_len}


class ModelRegistry:
    def __init__(self, models: list[ServedModel]) -> None:
        self._models = {m.name: m for m in models}

    @classmethod
    def load(cls, specs: tuple[ModelSpec, ...]) -> "ModelRegistry":
        return cls([ServedModel.load(s) for s in specs])

    def get(self, name: str) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            raise APIError(404, f"The model '{name}' does not exist. Served models: {sorted(self._models)}.",
                           param="model", code="model_not_found")
        return model

    def listing(self) -> dict:
        return {"object": "list", "data": [m.card() for m in self._models.values()]}
