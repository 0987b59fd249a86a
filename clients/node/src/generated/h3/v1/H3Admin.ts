// Original file: ../../protos/h3/v1/h3.proto

import type * as grpc from '@grpc/grpc-js'
import type { MethodDefinition } from '@grpc/proto-loader'
import type { DrainRequest as _h3_v1_DrainRequest, DrainRequest__Output as _h3_v1_DrainRequest__Output } from '../../h3/v1/DrainRequest.js';
import type { DrainResponse as _h3_v1_DrainResponse, DrainResponse__Output as _h3_v1_DrainResponse__Output } from '../../h3/v1/DrainResponse.js';
import type { EvictSessionRequest as _h3_v1_EvictSessionRequest, EvictSessionRequest__Output as _h3_v1_EvictSessionRequest__Output } from '../../h3/v1/EvictSessionRequest.js';
import type { EvictSessionResponse as _h3_v1_EvictSessionResponse, EvictSessionResponse__Output as _h3_v1_EvictSessionResponse__Output } from '../../h3/v1/EvictSessionResponse.js';
import type { GetConfigRequest as _h3_v1_GetConfigRequest, GetConfigRequest__Output as _h3_v1_GetConfigRequest__Output } from '../../h3/v1/GetConfigRequest.js';
import type { GetConfigResponse as _h3_v1_GetConfigResponse, GetConfigResponse__Output as _h3_v1_GetConfigResponse__Output } from '../../h3/v1/GetConfigResponse.js';
import type { PinSessionRequest as _h3_v1_PinSessionRequest, PinSessionRequest__Output as _h3_v1_PinSessionRequest__Output } from '../../h3/v1/PinSessionRequest.js';
import type { ResumeRequest as _h3_v1_ResumeRequest, ResumeRequest__Output as _h3_v1_ResumeRequest__Output } from '../../h3/v1/ResumeRequest.js';
import type { ResumeResponse as _h3_v1_ResumeResponse, ResumeResponse__Output as _h3_v1_ResumeResponse__Output } from '../../h3/v1/ResumeResponse.js';
import type { Session as _h3_v1_Session, Session__Output as _h3_v1_Session__Output } from '../../h3/v1/Session.js';
import type { SetPolicyRequest as _h3_v1_SetPolicyRequest, SetPolicyRequest__Output as _h3_v1_SetPolicyRequest__Output } from '../../h3/v1/SetPolicyRequest.js';
import type { SnapshotSessionRequest as _h3_v1_SnapshotSessionRequest, SnapshotSessionRequest__Output as _h3_v1_SnapshotSessionRequest__Output } from '../../h3/v1/SnapshotSessionRequest.js';
import type { SnapshotSessionResponse as _h3_v1_SnapshotSessionResponse, SnapshotSessionResponse__Output as _h3_v1_SnapshotSessionResponse__Output } from '../../h3/v1/SnapshotSessionResponse.js';

export interface H3AdminClient extends grpc.Client {
  /**
   * Stop accepting requests; wait for those in flight (up to `timeout_s`), cancel the rest.
   */
  Drain(argument: _h3_v1_DrainRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  Drain(argument: _h3_v1_DrainRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  Drain(argument: _h3_v1_DrainRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  Drain(argument: _h3_v1_DrainRequest, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  /**
   * Stop accepting requests; wait for those in flight (up to `timeout_s`), cancel the rest.
   */
  drain(argument: _h3_v1_DrainRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  drain(argument: _h3_v1_DrainRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  drain(argument: _h3_v1_DrainRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  drain(argument: _h3_v1_DrainRequest, callback: grpc.requestCallback<_h3_v1_DrainResponse__Output>): grpc.ClientUnaryCall;
  
  /**
   * Move a session's KV blocks down to DDR or to the SSD archive now.
   */
  EvictSession(argument: _h3_v1_EvictSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  EvictSession(argument: _h3_v1_EvictSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  EvictSession(argument: _h3_v1_EvictSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  EvictSession(argument: _h3_v1_EvictSessionRequest, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  /**
   * Move a session's KV blocks down to DDR or to the SSD archive now.
   */
  evictSession(argument: _h3_v1_EvictSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  evictSession(argument: _h3_v1_EvictSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  evictSession(argument: _h3_v1_EvictSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  evictSession(argument: _h3_v1_EvictSessionRequest, callback: grpc.requestCallback<_h3_v1_EvictSessionResponse__Output>): grpc.ClientUnaryCall;
  
  /**
   * The daemon's effective configuration (secrets left out).
   */
  GetConfig(argument: _h3_v1_GetConfigRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  GetConfig(argument: _h3_v1_GetConfigRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  GetConfig(argument: _h3_v1_GetConfigRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  GetConfig(argument: _h3_v1_GetConfigRequest, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  /**
   * The daemon's effective configuration (secrets left out).
   */
  getConfig(argument: _h3_v1_GetConfigRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  getConfig(argument: _h3_v1_GetConfigRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  getConfig(argument: _h3_v1_GetConfigRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  getConfig(argument: _h3_v1_GetConfigRequest, callback: grpc.requestCallback<_h3_v1_GetConfigResponse__Output>): grpc.ClientUnaryCall;
  
  /**
   * Keep a session's HBM blocks in HBM (no demotion while idle), for `ttl_s` seconds or until
   * unpinned.
   */
  PinSession(argument: _h3_v1_PinSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  PinSession(argument: _h3_v1_PinSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  PinSession(argument: _h3_v1_PinSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  PinSession(argument: _h3_v1_PinSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  /**
   * Keep a session's HBM blocks in HBM (no demotion while idle), for `ttl_s` seconds or until
   * unpinned.
   */
  pinSession(argument: _h3_v1_PinSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  pinSession(argument: _h3_v1_PinSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  pinSession(argument: _h3_v1_PinSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  pinSession(argument: _h3_v1_PinSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  
  /**
   * Undo a Drain: accept requests again and report SERVING (a SIGTERM drain is not undone).
   */
  Resume(argument: _h3_v1_ResumeRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  Resume(argument: _h3_v1_ResumeRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  Resume(argument: _h3_v1_ResumeRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  Resume(argument: _h3_v1_ResumeRequest, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  /**
   * Undo a Drain: accept requests again and report SERVING (a SIGTERM drain is not undone).
   */
  resume(argument: _h3_v1_ResumeRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  resume(argument: _h3_v1_ResumeRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  resume(argument: _h3_v1_ResumeRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  resume(argument: _h3_v1_ResumeRequest, callback: grpc.requestCallback<_h3_v1_ResumeResponse__Output>): grpc.ClientUnaryCall;
  
  /**
   * Switch the HBF policy of a session's decode steps.
   */
  SetPolicy(argument: _h3_v1_SetPolicyRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  SetPolicy(argument: _h3_v1_SetPolicyRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  SetPolicy(argument: _h3_v1_SetPolicyRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  SetPolicy(argument: _h3_v1_SetPolicyRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  /**
   * Switch the HBF policy of a session's decode steps.
   */
  setPolicy(argument: _h3_v1_SetPolicyRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  setPolicy(argument: _h3_v1_SetPolicyRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  setPolicy(argument: _h3_v1_SetPolicyRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  setPolicy(argument: _h3_v1_SetPolicyRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  
  /**
   * Make every full block of a session durable in the SSD archive now (copies stay where they are).
   */
  SnapshotSession(argument: _h3_v1_SnapshotSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  SnapshotSession(argument: _h3_v1_SnapshotSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  SnapshotSession(argument: _h3_v1_SnapshotSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  SnapshotSession(argument: _h3_v1_SnapshotSessionRequest, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  /**
   * Make every full block of a session durable in the SSD archive now (copies stay where they are).
   */
  snapshotSession(argument: _h3_v1_SnapshotSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  snapshotSession(argument: _h3_v1_SnapshotSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  snapshotSession(argument: _h3_v1_SnapshotSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  snapshotSession(argument: _h3_v1_SnapshotSessionRequest, callback: grpc.requestCallback<_h3_v1_SnapshotSessionResponse__Output>): grpc.ClientUnaryCall;
  
}

export interface H3AdminHandlers extends grpc.UntypedServiceImplementation {
  /**
   * Stop accepting requests; wait for those in flight (up to `timeout_s`), cancel the rest.
   */
  Drain: grpc.handleUnaryCall<_h3_v1_DrainRequest__Output, _h3_v1_DrainResponse>;
  
  /**
   * Move a session's KV blocks down to DDR or to the SSD archive now.
   */
  EvictSession: grpc.handleUnaryCall<_h3_v1_EvictSessionRequest__Output, _h3_v1_EvictSessionResponse>;
  
  /**
   * The daemon's effective configuration (secrets left out).
   */
  GetConfig: grpc.handleUnaryCall<_h3_v1_GetConfigRequest__Output, _h3_v1_GetConfigResponse>;
  
  /**
   * Keep a session's HBM blocks in HBM (no demotion while idle), for `ttl_s` seconds or until
   * unpinned.
   */
  PinSession: grpc.handleUnaryCall<_h3_v1_PinSessionRequest__Output, _h3_v1_Session>;
  
  /**
   * Undo a Drain: accept requests again and report SERVING (a SIGTERM drain is not undone).
   */
  Resume: grpc.handleUnaryCall<_h3_v1_ResumeRequest__Output, _h3_v1_ResumeResponse>;
  
  /**
   * Switch the HBF policy of a session's decode steps.
   */
  SetPolicy: grpc.handleUnaryCall<_h3_v1_SetPolicyRequest__Output, _h3_v1_Session>;
  
  /**
   * Make every full block of a session durable in the SSD archive now (copies stay where they are).
   */
  SnapshotSession: grpc.handleUnaryCall<_h3_v1_SnapshotSessionRequest__Output, _h3_v1_SnapshotSessionResponse>;
  
}

export interface H3AdminDefinition extends grpc.ServiceDefinition {
  Drain: MethodDefinition<_h3_v1_DrainRequest, _h3_v1_DrainResponse, _h3_v1_DrainRequest__Output, _h3_v1_DrainResponse__Output>
  EvictSession: MethodDefinition<_h3_v1_EvictSessionRequest, _h3_v1_EvictSessionResponse, _h3_v1_EvictSessionRequest__Output, _h3_v1_EvictSessionResponse__Output>
  GetConfig: MethodDefinition<_h3_v1_GetConfigRequest, _h3_v1_GetConfigResponse, _h3_v1_GetConfigRequest__Output, _h3_v1_GetConfigResponse__Output>
  PinSession: MethodDefinition<_h3_v1_PinSessionRequest, _h3_v1_Session, _h3_v1_PinSessionRequest__Output, _h3_v1_Session__Output>
  Resume: MethodDefinition<_h3_v1_ResumeRequest, _h3_v1_ResumeResponse, _h3_v1_ResumeRequest__Output, _h3_v1_ResumeResponse__Output>
  SetPolicy: MethodDefinition<_h3_v1_SetPolicyRequest, _h3_v1_Session, _h3_v1_SetPolicyRequest__Output, _h3_v1_Session__Output>
  SnapshotSession: MethodDefinition<_h3_v1_SnapshotSessionRequest, _h3_v1_SnapshotSessionResponse, _h3_v1_SnapshotSessionRequest__Output, _h3_v1_SnapshotSessionResponse__Output>
}
