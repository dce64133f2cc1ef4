// onnxtrain-web: train onnxtrain artifacts on stock onnxruntime-web (docs/web.md, docs/format.md).
export { CheckpointState, crc32 } from './checkpoint.js';
export { Module } from './module.js';
export { Optimizer } from './optimizer.js';
export { LinearLRScheduler } from './lr_scheduler.js';
export { OnnxtrainError } from './format.js';
