// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

/**
 * The KV tiers' counters and occupancy. Counters count blocks (one layer's `block_size` tokens)
 * since the daemon started.
 */
export interface TierStats {
  /**
   * Blocks read by attention that were in HBM / all blocks read.
   */
  'hbmHitRate'?: (number | string);
  'hbmHits'?: (number | string | Long);
  'hbmMisses'?: (number | string | Long);
  /**
   * DDR copies dropped (after a durable archive write, or because HBM holds a copy).
   */
  'ddrEvictCount'?: (number | string | Long);
  /**
   * HBM copies dropped (demoted to DDR).
   */
  'hbmEvictCount'?: (number | string | Long);
  /**
   * Blocks read back from the SSD archive / written to it.
   */
  'ssdReadCount'?: (number | string | Long);
  'ssdWriteCount'?: (number | string | Long);
  /**
   * Host-side HBF planning per decode step, over the last steps (microseconds).
   */
  'hbfLatencyUsP50'?: (number | string);
  'hbfLatencyUsP99'?: (number | string);
  'hbmUsedBytes'?: (number | string | Long);
  'hbmCapacityBytes'?: (number | string | Long);
  'ddrUsedBytes'?: (number | string | Long);
  'ddrCapacityBytes'?: (number | string | Long);
  /**
   * What ssd_capacity_mb counts: the bytes of the records the archive holds now (a record several
   * sessions share counted once) and of the digest snapshots beside them, with room for the next
   * snapshot of each session whose digests are on the device. The segments on disk hold up to a
   * third more until a compaction gives back the space of deleted records.
   */
  'ssdUsedBytes'?: (number | string | Long);
  /**
   * Bytes copied from DDR for attention.
   */
  'fetchBytes'?: (number | string | Long);
  /**
   * Blocks (block_size tokens, all layers) whose KV was computed again because the archive lacked
   * them (a restart after a crash) or held them damaged.
   */
  'kvRebuildBlocks'?: (number | string | Long);
  /**
   * The SSD tier takes no writes now (a full disk, an I/O error): the daemon serves from HBM and
   * DDR, and frees DDR by forgetting idle sessions' KV (recomputed when next used). It is tried
   * again every ssd_retry_interval_s.
   */
  'ssdDegraded'?: (boolean);
  /**
   * Why it is degraded (the failed write's error); empty when it is not.
   */
  'ssdDegradedReason'?: (string);
  /**
   * Archive writes that failed since start.
   */
  'ssdWriteErrors'?: (number | string | Long);
  /**
   * Block copies (one layer's block) forgotten while the SSD tier was degraded, to be computed
   * again from the token log when their session is next used.
   */
  'recomputeEvictCount'?: (number | string | Long);
  /**
   * Blocks (one layer's block each) moved between HBM and DDR toward the active sessions' fair
   * shares of HBM (h3d.tiers.shares), both ways.
   */
  'hbmRebalanceCount'?: (number | string | Long);
  /**
   * KV bytes of full blocks without a durable archive copy: what a shutdown's checkpoint must
   * write, or a crash leaves to compute again from the token logs. Write-behind keeps it within
   * write_behind_dirty_mb.
   */
  'dirtyBytes'?: (number | string | Long);
  /**
   * KV bytes written to the archive in the background since start (before compression).
   */
  'writeBehindBytes'?: (number | string | Long);
  /**
   * KV bytes submitted to the archive by write-behind and not yet durable.
   */
  'writeBehindInFlightBytes'?: (number | string | Long);
  /**
   * Seconds the dirty KV has been past write_behind_dirty_mb without a pause (0: within it): how
   * far the archive lags behind.
   */
  'writeBehindLagS'?: (number | string);
  /**
   * KV bytes of resumed sessions read back from the archive into DDR in the background since
   * start (h3d.tiers.readahead), and those being read now.
   */
  'readAheadBytes'?: (number | string | Long);
  'readAheadInFlightBytes'?: (number | string | Long);
  /**
   * Sliding-window layers' blocks (one layer's block each) freed once every later token's window
   * had passed them, since start: never demoted, archived or read again.
   */
  'windowFreedBlocks'?: (number | string | Long);
  /**
   * HBM bytes the sliding-window layers' blocks hold now (part of hbm_used_bytes): a window's
   * blocks per session and layer, whatever the context's length.
   */
  'windowHbmBytes'?: (number | string | Long);
  /**
   * Blocks (one layer's block each) that several sessions point to now: a fork's, a reused
   * prefix's (h3d.kv.blocks), held once in each tier.
   */
  'sharedBlocks'?: (number | string | Long);
  /**
   * HBM and DDR bytes that sharing saves now: what the sessions beyond the first would hold if
   * each had its own copies of the shared blocks.
   */
  'sharedHbmSavedBytes'?: (number | string | Long);
  'sharedDdrSavedBytes'?: (number | string | Long);
  /**
   * The remote tier (remote_url): whether its store takes the token logs' copies now (false:
   * degraded, `remote_degraded_reason` says why; the copies catch up by themselves when it is
   * back), and the bytes of the local logs it does not hold yet. Both 0 / false without the tier.
   */
  'remoteOn'?: (boolean);
  'remoteDegraded'?: (boolean);
  'remoteDegradedReason'?: (string);
  'remoteLagBytes'?: (number | string | Long);
  /**
   * KV blocks write-behind archived, copied to the remote store as well (remote_kv_copy_mb): bytes
   * sent since start (as stored: compressed), bytes waiting to be sent, and blocks skipped (the
   * queue full or the store unavailable; written when their session is given up).
   */
  'remoteKvCopiedBytes'?: (number | string | Long);
  'remoteKvCopyQueuedBytes'?: (number | string | Long);
  'remoteKvCopySkippedBlocks'?: (number | string | Long);
  /**
   * Bytes of the sessions' block digests (h3d.hbf.digests: what HBF's selection reads each step,
   * on the compute device, about 1/8 of the KV in bf16), and what the digests shared with their
   * blocks (forks, reused prefixes) save: the bytes those sessions would hold again in copies.
   */
  'digestBytes'?: (number | string | Long);
  'digestSharedSavedBytes'?: (number | string | Long);
  /**
   * Idle sessions whose digests were taken off the device to make room for a request's, since
   * start: each gets them back at its next step, from its snapshot (h3d.tiers.digestfile). A
   * count that keeps rising means the device holds fewer sessions' digests than are in use.
   */
  'digestsSetAside'?: (number | string | Long);
  /**
   * Bytes of KV blocks copied between HBM and DDR since start, for any reason: up (DDR -> HBM:
   * HBF's promotions, the fair shares' fills, DDR-only blocks brought back) and down (HBM -> DDR:
   * victims and demoted blocks that had no DDR copy). They cross PCIe beside what attention reads
   * from DDR in place (fetch_bytes); a rate near the link's bandwidth means HBM churns.
   */
  'copyUpBytes'?: (number | string | Long);
  'copyDownBytes'?: (number | string | Long);
}

/**
 * The KV tiers' counters and occupancy. Counters count blocks (one layer's `block_size` tokens)
 * since the daemon started.
 */
export interface TierStats__Output {
  /**
   * Blocks read by attention that were in HBM / all blocks read.
   */
  'hbmHitRate': (number);
  'hbmHits': (number);
  'hbmMisses': (number);
  /**
   * DDR copies dropped (after a durable archive write, or because HBM holds a copy).
   */
  'ddrEvictCount': (number);
  /**
   * HBM copies dropped (demoted to DDR).
   */
  'hbmEvictCount': (number);
  /**
   * Blocks read back from the SSD archive / written to it.
   */
  'ssdReadCount': (number);
  'ssdWriteCount': (number);
  /**
   * Host-side HBF planning per decode step, over the last steps (microseconds).
   */
  'hbfLatencyUsP50': (number);
  'hbfLatencyUsP99': (number);
  'hbmUsedBytes': (number);
  'hbmCapacityBytes': (number);
  'ddrUsedBytes': (number);
  'ddrCapacityBytes': (number);
  /**
   * What ssd_capacity_mb counts: the bytes of the records the archive holds now (a record several
   * sessions share counted once) and of the digest snapshots beside them, with room for the next
   * snapshot of each session whose digests are on the device. The segments on disk hold up to a
   * third more until a compaction gives back the space of deleted records.
   */
  'ssdUsedBytes': (number);
  /**
   * Bytes copied from DDR for attention.
   */
  'fetchBytes': (number);
  /**
   * Blocks (block_size tokens, all layers) whose KV was computed again because the archive lacked
   * them (a restart after a crash) or held them damaged.
   */
  'kvRebuildBlocks': (number);
  /**
   * The SSD tier takes no writes now (a full disk, an I/O error): the daemon serves from HBM and
   * DDR, and frees DDR by forgetting idle sessions' KV (recomputed when next used). It is tried
   * again every ssd_retry_interval_s.
   */
  'ssdDegraded': (boolean);
  /**
   * Why it is degraded (the failed write's error); empty when it is not.
   */
  'ssdDegradedReason': (string);
  /**
   * Archive writes that failed since start.
   */
  'ssdWriteErrors': (number);
  /**
   * Block copies (one layer's block) forgotten while the SSD tier was degraded, to be computed
   * again from the token log when their session is next used.
   */
  'recomputeEvictCount': (number);
  /**
   * Blocks (one layer's block each) moved between HBM and DDR toward the active sessions' fair
   * shares of HBM (h3d.tiers.shares), both ways.
   */
  'hbmRebalanceCount': (number);
  /**
   * KV bytes of full blocks without a durable archive copy: what a shutdown's checkpoint must
   * write, or a crash leaves to compute again from the token logs. Write-behind keeps it within
   * write_behind_dirty_mb.
   */
  'dirtyBytes': (number);
  /**
   * KV bytes written to the archive in the background since start (before compression).
   */
  'writeBehindBytes': (number);
  /**
   * KV bytes submitted to the archive by write-behind and not yet durable.
   */
  'writeBehindInFlightBytes': (number);
  /**
   * Seconds the dirty KV has been past write_behind_dirty_mb without a pause (0: within it): how
   * far the archive lags behind.
   */
  'writeBehindLagS': (number);
  /**
   * KV bytes of resumed sessions read back from the archive into DDR in the background since
   * start (h3d.tiers.readahead), and those being read now.
   */
  'readAheadBytes': (number);
  'readAheadInFlightBytes': (number);
  /**
   * Sliding-window layers' blocks (one layer's block each) freed once every later token's window
   * had passed them, since start: never demoted, archived or read again.
   */
  'windowFreedBlocks': (number);
  /**
   * HBM bytes the sliding-window layers' blocks hold now (part of hbm_used_bytes): a window's
   * blocks per session and layer, whatever the context's length.
   */
  'windowHbmBytes': (number);
  /**
   * Blocks (one layer's block each) that several sessions point to now: a fork's, a reused
   * prefix's (h3d.kv.blocks), held once in each tier.
   */
  'sharedBlocks': (number);
  /**
   * HBM and DDR bytes that sharing saves now: what the sessions beyond the first would hold if
   * each had its own copies of the shared blocks.
   */
  'sharedHbmSavedBytes': (number);
  'sharedDdrSavedBytes': (number);
  /**
   * The remote tier (remote_url): whether its store takes the token logs' copies now (false:
   * degraded, `remote_degraded_reason` says why; the copies catch up by themselves when it is
   * back), and the bytes of the local logs it does not hold yet. Both 0 / false without the tier.
   */
  'remoteOn': (boolean);
  'remoteDegraded': (boolean);
  'remoteDegradedReason': (string);
  'remoteLagBytes': (number);
  /**
   * KV blocks write-behind archived, copied to the remote store as well (remote_kv_copy_mb): bytes
   * sent since start (as stored: compressed), bytes waiting to be sent, and blocks skipped (the
   * queue full or the store unavailable; written when their session is given up).
   */
  'remoteKvCopiedBytes': (number);
  'remoteKvCopyQueuedBytes': (number);
  'remoteKvCopySkippedBlocks': (number);
  /**
   * Bytes of the sessions' block digests (h3d.hbf.digests: what HBF's selection reads each step,
   * on the compute device, about 1/8 of the KV in bf16), and what the digests shared with their
   * blocks (forks, reused prefixes) save: the bytes those sessions would hold again in copies.
   */
  'digestBytes': (number);
  'digestSharedSavedBytes': (number);
  /**
   * Idle sessions whose digests were taken off the device to make room for a request's, since
   * start: each gets them back at its next step, from its snapshot (h3d.tiers.digestfile). A
   * count that keeps rising means the device holds fewer sessions' digests than are in use.
   */
  'digestsSetAside': (number);
  /**
   * Bytes of KV blocks copied between HBM and DDR since start, for any reason: up (DDR -> HBM:
   * HBF's promotions, the fair shares' fills, DDR-only blocks brought back) and down (HBM -> DDR:
   * victims and demoted blocks that had no DDR copy). They cross PCIe beside what attention reads
   * from DDR in place (fetch_bytes); a rate near the link's bandwidth means HBM churns.
   */
  'copyUpBytes': (number);
  'copyDownBytes': (number);
}
