// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

export interface SnapshotSessionResponse {
  /**
   * Blocks written to the archive now (those already archived are not written again).
   */
  'blocksWritten'?: (number | string | Long);
  'seconds'?: (number | string);
}

export interface SnapshotSessionResponse__Output {
  /**
   * Blocks written to the archive now (those already archived are not written again).
   */
  'blocksWritten': (number);
  'seconds': (number);
}
