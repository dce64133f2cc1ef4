// Learning-rate schedulers: each sets the optimizer's learning rate once per step().
import { OnnxtrainError } from './format.js';

/** Linear warmup from 0 to initialLr over warmupStepCount steps, then linear decay to 0 at totalStepCount. */
export class LinearLRScheduler {
  constructor(optimizer, warmupStepCount, totalStepCount, initialLr) {
    if (warmupStepCount < 0 || totalStepCount < warmupStepCount) {
      throw new OnnxtrainError(`need 0 <= warmupStepCount <= totalStepCount, got ${warmupStepCount}, ${totalStepCount}`);
    }
    this.optimizer = optimizer;
    this.warmup = warmupStepCount;
    this.total = totalStepCount;
    this.initialLr = initialLr;
    this.stepCount = 0;
    optimizer.setLearningRate(initialLr * this.factor(0));
  }

  factor(step) {
    if (step < this.warmup) return step / Math.max(1, this.warmup);
    return Math.max(0, (this.total - step) / Math.max(1, this.total - this.warmup));
  }

  step() {
    this.stepCount += 1;
    this.optimizer.setLearningRate(this.initialLr * this.factor(this.stepCount));
  }
}
