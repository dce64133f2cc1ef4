"""onnxruntime sessions, IO binding, and zero-copy OrtValue <-> torch conversion (DLPack)."""
