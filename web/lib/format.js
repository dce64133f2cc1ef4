// The artifact format's names and the flat layout's chunking (docs/format.md), as the Python runtime's
// onnxtrain/ondevice/format.py and onnxtrain/utils/chunks.py.

export const TRAINING_METADATA_KEY = 'onnxtrain.training';
export const OPTIMIZER_METADATA_KEY = 'onnxtrain.optimizer';
export const TRAINING_MODEL_FORMAT = 2;
export const LEARNING_RATE = 'learning_rate';
export const STEP = 'step';
export const PARAMS = 'params';
export const GRADIENTS = 'gradients';
export const OUTPUT_SUFFIX = '.out';
export const CHUNK = 1 << 18;

/** The optimizer model's input holding the flat `prefix` vector of element type `dtype`. */
export const flatName = (prefix, dtype) => `${prefix}.${dtype}`;
/** The optimizer model's output holding the new value of `inputName`. */
export const updatedName = (inputName) => inputName + OUTPUT_SUFFIX;

/** [number of chunks, chunk length] of a flat vector of `size` elements (padded to their product). */
export function chunking(size) {
  if (size <= CHUNK) return [1, Math.max(size, 1)];
  return [Math.ceil(size / CHUNK), CHUNK];
}

export class OnnxtrainError extends Error {
  constructor(message) {
    super(message);
    this.name = 'OnnxtrainError';
  }
}
