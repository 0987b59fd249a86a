// Original file: ../../protos/h3/v1/h3.proto

import type * as grpc from '@grpc/grpc-js'
import type { MethodDefinition } from '@grpc/proto-loader'
import type { AppendContextRequest as _h3_v1_AppendContextRequest, AppendContextRequest__Output as _h3_v1_AppendContextRequest__Output } from '../../h3/v1/AppendContextRequest.js';
import type { AppendContextResponse as _h3_v1_AppendContextResponse, AppendContextResponse__Output as _h3_v1_AppendContextResponse__Output } from '../../h3/v1/AppendContextResponse.js';
import type { CloseSessionRequest as _h3_v1_CloseSessionRequest, CloseSessionRequest__Output as _h3_v1_CloseSessionRequest__Output } from '../../h3/v1/CloseSessionRequest.js';
import type { CloseSessionResponse as _h3_v1_CloseSessionResponse, CloseSessionResponse__Output as _h3_v1_CloseSessionResponse__Output } from '../../h3/v1/CloseSessionResponse.js';
import type { CreateSessionRequest as _h3_v1_CreateSessionRequest, CreateSessionRequest__Output as _h3_v1_CreateSessionRequest__Output } from '../../h3/v1/CreateSessionRequest.js';
import type { ForkSessionRequest as _h3_v1_ForkSessionRequest, ForkSessionRequest__Output as _h3_v1_ForkSessionRequest__Output } from '../../h3/v1/ForkSessionRequest.js';
import type { GenerateRequest as _h3_v1_GenerateRequest, GenerateRequest__Output as _h3_v1_GenerateRequest__Output } from '../../h3/v1/GenerateRequest.js';
import type { GenerateResponse as _h3_v1_GenerateResponse, GenerateResponse__Output as _h3_v1_GenerateResponse__Output } from '../../h3/v1/GenerateResponse.js';
import type { GetSessionRequest as _h3_v1_GetSessionRequest, GetSessionRequest__Output as _h3_v1_GetSessionRequest__Output } from '../../h3/v1/GetSessionRequest.js';
import type { GetStatsRequest as _h3_v1_GetStatsRequest, GetStatsRequest__Output as _h3_v1_GetStatsRequest__Output } from '../../h3/v1/GetStatsRequest.js';
import type { ListSessionsRequest as _h3_v1_ListSessionsRequest, ListSessionsRequest__Output as _h3_v1_ListSessionsRequest__Output } from '../../h3/v1/ListSessionsRequest.js';
import type { ListSessionsResponse as _h3_v1_ListSessionsResponse, ListSessionsResponse__Output as _h3_v1_ListSessionsResponse__Output } from '../../h3/v1/ListSessionsResponse.js';
import type { ReleaseSessionRequest as _h3_v1_ReleaseSessionRequest, ReleaseSessionRequest__Output as _h3_v1_ReleaseSessionRequest__Output } from '../../h3/v1/ReleaseSessionRequest.js';
import type { ReleaseSessionResponse as _h3_v1_ReleaseSessionResponse, ReleaseSessionResponse__Output as _h3_v1_ReleaseSessionResponse__Output } from '../../h3/v1/ReleaseSessionResponse.js';
import type { Session as _h3_v1_Session, Session__Output as _h3_v1_Session__Output } from '../../h3/v1/Session.js';
import type { Stats as _h3_v1_Stats, Stats__Output as _h3_v1_Stats__Output } from '../../h3/v1/Stats.js';

export interface H3Client extends grpc.Client {
  /**
   * Add text or token ids to a session's context and prefill them. Streams progress, then one
   * summary.
   */
  AppendContext(argument: _h3_v1_AppendContextRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_AppendContextResponse__Output>;
  AppendContext(argument: _h3_v1_AppendContextRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_AppendContextResponse__Output>;
  /**
   * Add text or token ids to a session's context and prefill them. Streams progress, then one
   * summary.
   */
  appendContext(argument: _h3_v1_AppendContextRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_AppendContextResponse__Output>;
  appendContext(argument: _h3_v1_AppendContextRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_AppendContextResponse__Output>;
  
  /**
   * Close a session and free its KV in every tier.
   */
  CloseSession(argument: _h3_v1_CloseSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  CloseSession(argument: _h3_v1_CloseSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  CloseSession(argument: _h3_v1_CloseSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  CloseSession(argument: _h3_v1_CloseSessionRequest, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  /**
   * Close a session and free its KV in every tier.
   */
  closeSession(argument: _h3_v1_CloseSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  closeSession(argument: _h3_v1_CloseSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  closeSession(argument: _h3_v1_CloseSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  closeSession(argument: _h3_v1_CloseSessionRequest, callback: grpc.requestCallback<_h3_v1_CloseSessionResponse__Output>): grpc.ClientUnaryCall;
  
  /**
   * Open a session, optionally with a system prompt (prefilled lazily, with the first request).
   */
  CreateSession(argument: _h3_v1_CreateSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  CreateSession(argument: _h3_v1_CreateSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  CreateSession(argument: _h3_v1_CreateSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  CreateSession(argument: _h3_v1_CreateSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  /**
   * Open a session, optionally with a system prompt (prefilled lazily, with the first request).
   */
  createSession(argument: _h3_v1_CreateSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  createSession(argument: _h3_v1_CreateSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  createSession(argument: _h3_v1_CreateSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  createSession(argument: _h3_v1_CreateSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  
  /**
   * A new session whose context is the first `at_tokens` tokens of another's (all of them by
   * default), with its policy, sampling defaults and chat conversation. Its KV blocks are the
   * other session's, shared where it holds them in HBM or DDR (held once for both), and its last
   * tokens are prefilled before this returns, so the fork is ready to decode. FAILED_PRECONDITION while the session has a request in flight;
   * INVALID_ARGUMENT for `at_tokens` past its context or inside a chat message.
   */
  ForkSession(argument: _h3_v1_ForkSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  ForkSession(argument: _h3_v1_ForkSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  ForkSession(argument: _h3_v1_ForkSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  ForkSession(argument: _h3_v1_ForkSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  /**
   * A new session whose context is the first `at_tokens` tokens of another's (all of them by
   * default), with its policy, sampling defaults and chat conversation. Its KV blocks are the
   * other session's, shared where it holds them in HBM or DDR (held once for both), and its last
   * tokens are prefilled before this returns, so the fork is ready to decode. FAILED_PRECONDITION while the session has a request in flight;
   * INVALID_ARGUMENT for `at_tokens` past its context or inside a chat message.
   */
  forkSession(argument: _h3_v1_ForkSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  forkSession(argument: _h3_v1_ForkSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  forkSession(argument: _h3_v1_ForkSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  forkSession(argument: _h3_v1_ForkSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  
  /**
   * Generate, continuing the session's context (after appending `prompt`, if any). Streams the
   * tokens as they are produced, then one summary.
   */
  Generate(argument: _h3_v1_GenerateRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_GenerateResponse__Output>;
  Generate(argument: _h3_v1_GenerateRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_GenerateResponse__Output>;
  /**
   * Generate, continuing the session's context (after appending `prompt`, if any). Streams the
   * tokens as they are produced, then one summary.
   */
  generate(argument: _h3_v1_GenerateRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_GenerateResponse__Output>;
  generate(argument: _h3_v1_GenerateRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_h3_v1_GenerateResponse__Output>;
  
  /**
   * One session's metadata (and, with `with_tokens`, its whole context).
   */
  GetSession(argument: _h3_v1_GetSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  GetSession(argument: _h3_v1_GetSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  GetSession(argument: _h3_v1_GetSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  GetSession(argument: _h3_v1_GetSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  /**
   * One session's metadata (and, with `with_tokens`, its whole context).
   */
  getSession(argument: _h3_v1_GetSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  getSession(argument: _h3_v1_GetSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  getSession(argument: _h3_v1_GetSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  getSession(argument: _h3_v1_GetSessionRequest, callback: grpc.requestCallback<_h3_v1_Session__Output>): grpc.ClientUnaryCall;
  
  /**
   * Tier and throughput figures, global and per session.
   */
  GetStats(argument: _h3_v1_GetStatsRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  GetStats(argument: _h3_v1_GetStatsRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  GetStats(argument: _h3_v1_GetStatsRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  GetStats(argument: _h3_v1_GetStatsRequest, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  /**
   * Tier and throughput figures, global and per session.
   */
  getStats(argument: _h3_v1_GetStatsRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  getStats(argument: _h3_v1_GetStatsRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  getStats(argument: _h3_v1_GetStatsRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  getStats(argument: _h3_v1_GetStatsRequest, callback: grpc.requestCallback<_h3_v1_Stats__Output>): grpc.ClientUnaryCall;
  
  /**
   * The caller's sessions, oldest first, a page at a time.
   */
  ListSessions(argument: _h3_v1_ListSessionsRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  ListSessions(argument: _h3_v1_ListSessionsRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  ListSessions(argument: _h3_v1_ListSessionsRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  ListSessions(argument: _h3_v1_ListSessionsRequest, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  /**
   * The caller's sessions, oldest first, a page at a time.
   */
  listSessions(argument: _h3_v1_ListSessionsRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  listSessions(argument: _h3_v1_ListSessionsRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  listSessions(argument: _h3_v1_ListSessionsRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  listSessions(argument: _h3_v1_ListSessionsRequest, callback: grpc.requestCallback<_h3_v1_ListSessionsResponse__Output>): grpc.ClientUnaryCall;
  
  /**
   * Hand a session over to the other daemons of the remote tier (remote_url) at once: its token
   * log's last bytes reach the store, its lease is released, its requests here are cancelled and
   * this daemon forgets it (its KV too). The next call naming it on any daemon of the store takes
   * it over. FAILED_PRECONDITION without the remote tier; UNAVAILABLE if the store does not take
   * the log's last bytes (the session stays here).
   */
  ReleaseSession(argument: _h3_v1_ReleaseSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  ReleaseSession(argument: _h3_v1_ReleaseSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  ReleaseSession(argument: _h3_v1_ReleaseSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  ReleaseSession(argument: _h3_v1_ReleaseSessionRequest, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  /**
   * Hand a session over to the other daemons of the remote tier (remote_url) at once: its token
   * log's last bytes reach the store, its lease is released, its requests here are cancelled and
   * this daemon forgets it (its KV too). The next call naming it on any daemon of the store takes
   * it over. FAILED_PRECONDITION without the remote tier; UNAVAILABLE if the store does not take
   * the log's last bytes (the session stays here).
   */
  releaseSession(argument: _h3_v1_ReleaseSessionRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  releaseSession(argument: _h3_v1_ReleaseSessionRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  releaseSession(argument: _h3_v1_ReleaseSessionRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  releaseSession(argument: _h3_v1_ReleaseSessionRequest, callback: grpc.requestCallback<_h3_v1_ReleaseSessionResponse__Output>): grpc.ClientUnaryCall;
  
}

export interface H3Handlers extends grpc.UntypedServiceImplementation {
  /**
   * Add text or token ids to a session's context and prefill them. Streams progress, then one
   * summary.
   */
  AppendContext: grpc.handleServerStreamingCall<_h3_v1_AppendContextRequest__Output, _h3_v1_AppendContextResponse>;
  
  /**
   * Close a session and free its KV in every tier.
   */
  CloseSession: grpc.handleUnaryCall<_h3_v1_CloseSessionRequest__Output, _h3_v1_CloseSessionResponse>;
  
  /**
   * Open a session, optionally with a system prompt (prefilled lazily, with the first request).
   */
  CreateSession: grpc.handleUnaryCall<_h3_v1_CreateSessionRequest__Output, _h3_v1_Session>;
  
  /**
   * A new session whose context is the first `at_tokens` tokens of another's (all of them by
   * default), with its policy, sampling defaults and chat conversation. Its KV blocks are the
   * other session's, shared where it holds them in HBM or DDR (held once for both), and its last
   * tokens are prefilled before this returns, so the fork is ready to decode. FAILED_PRECONDITION while the session has a request in flight;
   * INVALID_ARGUMENT for `at_tokens` past its context or inside a chat message.
   */
  ForkSession: grpc.handleUnaryCall<_h3_v1_ForkSessionRequest__Output, _h3_v1_Session>;
  
  /**
   * Generate, continuing the session's context (after appending `prompt`, if any). Streams the
   * tokens as they are produced, then one summary.
   */
  Generate: grpc.handleServerStreamingCall<_h3_v1_GenerateRequest__Output, _h3_v1_GenerateResponse>;
  
  /**
   * One session's metadata (and, with `with_tokens`, its whole context).
   */
  GetSession: grpc.handleUnaryCall<_h3_v1_GetSessionRequest__Output, _h3_v1_Session>;
  
  /**
   * Tier and throughput figures, global and per session.
   */
  GetStats: grpc.handleUnaryCall<_h3_v1_GetStatsRequest__Output, _h3_v1_Stats>;
  
  /**
   * The caller's sessions, oldest first, a page at a time.
   */
  ListSessions: grpc.handleUnaryCall<_h3_v1_ListSessionsRequest__Output, _h3_v1_ListSessionsResponse>;
  
  /**
   * Hand a session over to the other daemons of the remote tier (remote_url) at once: its token
   * log's last bytes reach the store, its lease is released, its requests here are cancelled and
   * this daemon forgets it (its KV too). The next call naming it on any daemon of the store takes
   * it over. FAILED_PRECONDITION without the remote tier; UNAVAILABLE if the store does not take
   * the log's last bytes (the session stays here).
   */
  ReleaseSession: grpc.handleUnaryCall<_h3_v1_ReleaseSessionRequest__Output, _h3_v1_ReleaseSessionResponse>;
  
}

export interface H3Definition extends grpc.ServiceDefinition {
  AppendContext: MethodDefinition<_h3_v1_AppendContextRequest, _h3_v1_AppendContextResponse, _h3_v1_AppendContextRequest__Output, _h3_v1_AppendContextResponse__Output>
  CloseSession: MethodDefinition<_h3_v1_CloseSessionRequest, _h3_v1_CloseSessionResponse, _h3_v1_CloseSessionRequest__Output, _h3_v1_CloseSessionResponse__Output>
  CreateSession: MethodDefinition<_h3_v1_CreateSessionRequest, _h3_v1_Session, _h3_v1_CreateSessionRequest__Output, _h3_v1_Session__Output>
  ForkSession: MethodDefinition<_h3_v1_ForkSessionRequest, _h3_v1_Session, _h3_v1_ForkSessionRequest__Output, _h3_v1_Session__Output>
  Generate: MethodDefinition<_h3_v1_GenerateRequest, _h3_v1_GenerateResponse, _h3_v1_GenerateRequest__Output, _h3_v1_GenerateResponse__Output>
  GetSession: MethodDefinition<_h3_v1_GetSessionRequest, _h3_v1_Session, _h3_v1_GetSessionRequest__Output, _h3_v1_Session__Output>
  GetStats: MethodDefinition<_h3_v1_GetStatsRequest, _h3_v1_Stats, _h3_v1_GetStatsRequest__Output, _h3_v1_Stats__Output>
  ListSessions: MethodDefinition<_h3_v1_ListSessionsRequest, _h3_v1_ListSessionsResponse, _h3_v1_ListSessionsRequest__Output, _h3_v1_ListSessionsResponse__Output>
  ReleaseSession: MethodDefinition<_h3_v1_ReleaseSessionRequest, _h3_v1_ReleaseSessionResponse, _h3_v1_ReleaseSessionRequest__Output, _h3_v1_ReleaseSessionResponse__Output>
}
