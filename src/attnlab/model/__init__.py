from attnlab.model.transformer import ModelCache, ModelOutput, Transformer

__all__ = ["ModelCache", "ModelOutput", "Transformer"]
