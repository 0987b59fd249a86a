// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

/**
 * Where a session's KV blocks are, counted per layer and block (a block is `block_size` tokens of
 * one layer). A block may have copies in several tiers; each count includes copies.
 */
export interface TierResidency {
  'hbmBlocks'?: (number | string | Long);
  'ddrBlocks'?: (number | string | Long);
  /**
   * Blocks with a durable copy in the SSD archive.
   */
  'ssdBlocks'?: (number | string | Long);
}

/**
 * Where a session's KV blocks are, counted per layer and block (a block is `block_size` tokens of
 * one layer). A block may have copies in several tiers; each count includes copies.
 */
export interface TierResidency__Output {
  'hbmBlocks': (number);
  'ddrBlocks': (number);
  /**
   * Blocks with a durable copy in the SSD archive.
   */
  'ssdBlocks': (number);
}
