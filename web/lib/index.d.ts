// Types of onnxtrain-web (docs/web.md). Names follow onnxruntime-web's former training API where it had them.
import type { InferenceSession, Tensor } from 'onnxruntime-web';

/** A model or checkpoint: its bytes, or a URL to fetch. */
export type Source = string | URL | Uint8Array | ArrayBuffer;

export class OnnxtrainError extends Error {}

export interface Parameter {
  dtype: string;
  shape: number[];
  data: Float32Array | Float64Array | Uint16Array | Int8Array | Int16Array | Int32Array | BigInt64Array | Uint8Array | Uint32Array | BigUint64Array;
  requiresGrad: boolean;
}

export interface ModuleOptions {
  /** Default ['wasm']; e.g. ['webgpu', 'wasm']. */
  executionProviders?: InferenceSession.SessionOptions['executionProviders'];
  sessionOptions?: InferenceSession.SessionOptions;
}

/** Model inputs then loss inputs, by name or in order. */
export type Feeds = Record<string, Tensor> | Tensor[];

export class CheckpointState {
  /** In checkpoint order. */
  readonly parameters: Map<string, Parameter>;
  optimizerStep: number;
  learningRate: number | null;
  properties: Record<string, number | string>;
  readonly isNominal: boolean;
  static loadCheckpoint(source: Source): Promise<CheckpointState>;
  static fromBytes(bytes: Uint8Array | ArrayBuffer): CheckpointState;
  /** The checkpoint file's bytes; the optimizer state (step, learning rate, moments) only if asked. */
  static saveCheckpoint(state: CheckpointState, includeOptimizerState?: boolean): Uint8Array;
  toBytes(includeOptimizerState?: boolean): Uint8Array;
  /** The live data of a parameter (a view into the flat buffers once a Module trains it). */
  array(name: string): Parameter['data'];
  optimizerStates(): Map<string, Map<string, Float32Array>>;
}

export class Module {
  static create(trainModel: Source, state: CheckpointState, evalModel?: Source | null, options?: ModuleOptions): Promise<Module>;
  readonly state: CheckpointState;
  training: boolean;
  readonly trainingInputNames: string[];
  readonly trainingOutputNames: string[];
  readonly evalInputNames: string[];
  readonly evalOutputNames: string[];
  train(mode?: boolean): this;
  eval(): this;
  /** Forward and backward; gradients add up until lazyResetGrad(). Returns the outputs, the loss first. */
  trainStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  evalStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  lazyResetGrad(): void;
  getParametersSize(trainableOnly?: boolean): number;
  /** A float32 copy of the parameters in checkpoint order. */
  getContiguousParameters(trainableOnly?: boolean): Tensor;
  loadParametersBuffer(buffer: Float32Array | Uint8Array | Tensor, trainableOnly?: boolean): void;
}

export class Optimizer {
  static create(optimizerModel: Source, module: Module, options?: ModuleOptions): Promise<Optimizer>;
  step(): Promise<void>;
  /** Web artifacts' train_step_model.onnx: the training and optimizer models in one graph, for trainAndStep. */
  loadTrainStepModel(model: Source, options?: ModuleOptions): Promise<void>;
  /** trainStep, step and lazyResetGrad; one session call with the train-step model when no gradients were accumulated. */
  trainAndStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  setLearningRate(learningRate: number): void;
  getLearningRate(): number;
}

export class LinearLRScheduler {
  constructor(optimizer: Optimizer, warmupStepCount: number, totalStepCount: number, initialLr: number);
  step(): void;
}

export function crc32(bytes: Uint8Array): number;
