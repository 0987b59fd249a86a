// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

/**
 * Decode steps replayed as CUDA graphs (h3d.engine.graphs). Before it is ready the daemon
 * captures a named set (one session at every table width up to the longest context); a step
 * whose graph is outside it runs eagerly until the graph is captured between steps.
 */
export interface GraphStats {
  /**
   * Graphs captured since start, the warm-up's included (a CPU host captures none).
   */
  'capturesTotal'?: (number | string | Long);
  /**
   * Of those, captured after the daemon said it was ready (between steps, never on a step's path).
   */
  'capturesAfterReady'?: (number | string | Long);
  /**
   * Decode steps replayed through a graph.
   */
  'replaysTotal'?: (number | string | Long);
  /**
   * Decode steps run uncaptured (their graph's forward, each kernel launched) while their graph
   * waited to be captured.
   */
  'eagerStepsTotal'?: (number | string | Long);
  /**
   * Graphs in the warm set, and the seconds the warm-up took (kernels and graphs).
   */
  'warmGraphs'?: (number);
  'warmS'?: (number | string);
  /**
   * Graphs waiting to be captured now.
   */
  'deferred'?: (number);
  /**
   * Of those captured after ready, those captured ahead: before the step that gave sessions whose
   * prompts were appended before their first token, for the batch they then joined.
   */
  'capturesAhead'?: (number | string | Long);
}

/**
 * Decode steps replayed as CUDA graphs (h3d.engine.graphs). Before it is ready the daemon
 * captures a named set (one session at every table width up to the longest context); a step
 * whose graph is outside it runs eagerly until the graph is captured between steps.
 */
export interface GraphStats__Output {
  /**
   * Graphs captured since start, the warm-up's included (a CPU host captures none).
   */
  'capturesTotal': (number);
  /**
   * Of those, captured after the daemon said it was ready (between steps, never on a step's path).
   */
  'capturesAfterReady': (number);
  /**
   * Decode steps replayed through a graph.
   */
  'replaysTotal': (number);
  /**
   * Decode steps run uncaptured (their graph's forward, each kernel launched) while their graph
   * waited to be captured.
   */
  'eagerStepsTotal': (number);
  /**
   * Graphs in the warm set, and the seconds the warm-up took (kernels and graphs).
   */
  'warmGraphs': (number);
  'warmS': (number);
  /**
   * Graphs waiting to be captured now.
   */
  'deferred': (number);
  /**
   * Of those captured after ready, those captured ahead: before the step that gave sessions whose
   * prompts were appended before their first token, for the batch they then joined.
   */
  'capturesAhead': (number);
}
