"""The opening of a subprocess script in which importing torch (and onnx, onnx_ir, onnxscript,
transformers) fails: the on-device runtime and the federated client must run without them."""

BLOCK_IMPORTS = '''
import sys

BLOCKED = ("torch", "onnx", "onnx_ir", "onnxscript", "transformers")

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
'''
