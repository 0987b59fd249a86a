import type * as grpc from '@grpc/grpc-js';
import type { EnumTypeDefinition, MessageTypeDefinition } from '@grpc/proto-loader';

import type { AppendContextRequest as _h3_v1_AppendContextRequest, AppendContextRequest__Output as _h3_v1_AppendContextRequest__Output } from './h3/v1/AppendContextRequest.js';
import type { AppendContextResponse as _h3_v1_AppendContextResponse, AppendContextResponse__Output as _h3_v1_AppendContextResponse__Output } from './h3/v1/AppendContextResponse.js';
import type { AppendProgress as _h3_v1_AppendProgress, AppendProgress__Output as _h3_v1_AppendProgress__Output } from './h3/v1/AppendProgress.js';
import type { AppendSummary as _h3_v1_AppendSummary, AppendSummary__Output as _h3_v1_AppendSummary__Output } from './h3/v1/AppendSummary.js';
import type { CloseSessionRequest as _h3_v1_CloseSessionRequest, CloseSessionRequest__Output as _h3_v1_CloseSessionRequest__Output } from './h3/v1/CloseSessionRequest.js';
import type { CloseSessionResponse as _h3_v1_CloseSessionResponse, CloseSessionResponse__Output as _h3_v1_CloseSessionResponse__Output } from './h3/v1/CloseSessionResponse.js';
import type { CreateSessionRequest as _h3_v1_CreateSessionRequest, CreateSessionRequest__Output as _h3_v1_CreateSessionRequest__Output } from './h3/v1/CreateSessionRequest.js';
import type { DrainRequest as _h3_v1_DrainRequest, DrainRequest__Output as _h3_v1_DrainRequest__Output } from './h3/v1/DrainRequest.js';
import type { DrainResponse as _h3_v1_DrainResponse, DrainResponse__Output as _h3_v1_DrainResponse__Output } from './h3/v1/DrainResponse.js';
import type { EvictSessionRequest as _h3_v1_EvictSessionRequest, EvictSessionRequest__Output as _h3_v1_EvictSessionRequest__Output } from './h3/v1/EvictSessionRequest.js';
import type { EvictSessionResponse as _h3_v1_EvictSessionResponse, EvictSessionResponse__Output as _h3_v1_EvictSessionResponse__Output } from './h3/v1/EvictSessionResponse.js';
import type { ForkSessionRequest as _h3_v1_ForkSessionRequest, ForkSessionRequest__Output as _h3_v1_ForkSessionRequest__Output } from './h3/v1/ForkSessionRequest.js';
import type { GenerateRequest as _h3_v1_GenerateRequest, GenerateRequest__Output as _h3_v1_GenerateRequest__Output } from './h3/v1/GenerateRequest.js';
import type { GenerateResponse as _h3_v1_GenerateResponse, GenerateResponse__Output as _h3_v1_GenerateResponse__Output } from './h3/v1/GenerateResponse.js';
import type { GenerateSummary as _h3_v1_GenerateSummary, GenerateSummary__Output as _h3_v1_GenerateSummary__Output } from './h3/v1/GenerateSummary.js';
import type { GetConfigRequest as _h3_v1_GetConfigRequest, GetConfigRequest__Output as _h3_v1_GetConfigRequest__Output } from './h3/v1/GetConfigRequest.js';
import type { GetConfigResponse as _h3_v1_GetConfigResponse, GetConfigResponse__Output as _h3_v1_GetConfigResponse__Output } from './h3/v1/GetConfigResponse.js';
import type { GetSessionRequest as _h3_v1_GetSessionRequest, GetSessionRequest__Output as _h3_v1_GetSessionRequest__Output } from './h3/v1/GetSessionRequest.js';
import type { GetStatsRequest as _h3_v1_GetStatsRequest, GetStatsRequest__Output as _h3_v1_GetStatsRequest__Output } from './h3/v1/GetStatsRequest.js';
import type { GraphStats as _h3_v1_GraphStats, GraphStats__Output as _h3_v1_GraphStats__Output } from './h3/v1/GraphStats.js';
import type { H3Client as _h3_v1_H3Client, H3Definition as _h3_v1_H3Definition } from './h3/v1/H3.js';
import type { H3AdminClient as _h3_v1_H3AdminClient, H3AdminDefinition as _h3_v1_H3AdminDefinition } from './h3/v1/H3Admin.js';
import type { ListSessionsRequest as _h3_v1_ListSessionsRequest, ListSessionsRequest__Output as _h3_v1_ListSessionsRequest__Output } from './h3/v1/ListSessionsRequest.js';
import type { ListSessionsResponse as _h3_v1_ListSessionsResponse, ListSessionsResponse__Output as _h3_v1_ListSessionsResponse__Output } from './h3/v1/ListSessionsResponse.js';
import type { PinSessionRequest as _h3_v1_PinSessionRequest, PinSessionRequest__Output as _h3_v1_PinSessionRequest__Output } from './h3/v1/PinSessionRequest.js';
import type { ReleaseSessionRequest as _h3_v1_ReleaseSessionRequest, ReleaseSessionRequest__Output as _h3_v1_ReleaseSessionRequest__Output } from './h3/v1/ReleaseSessionRequest.js';
import type { ReleaseSessionResponse as _h3_v1_ReleaseSessionResponse, ReleaseSessionResponse__Output as _h3_v1_ReleaseSessionResponse__Output } from './h3/v1/ReleaseSessionResponse.js';
import type { ResumeRequest as _h3_v1_ResumeRequest, ResumeRequest__Output as _h3_v1_ResumeRequest__Output } from './h3/v1/ResumeRequest.js';
import type { ResumeResponse as _h3_v1_ResumeResponse, ResumeResponse__Output as _h3_v1_ResumeResponse__Output } from './h3/v1/ResumeResponse.js';
import type { SamplingParams as _h3_v1_SamplingParams, SamplingParams__Output as _h3_v1_SamplingParams__Output } from './h3/v1/SamplingParams.js';
import type { Session as _h3_v1_Session, Session__Output as _h3_v1_Session__Output } from './h3/v1/Session.js';
import type { SessionStats as _h3_v1_SessionStats, SessionStats__Output as _h3_v1_SessionStats__Output } from './h3/v1/SessionStats.js';
import type { SetPolicyRequest as _h3_v1_SetPolicyRequest, SetPolicyRequest__Output as _h3_v1_SetPolicyRequest__Output } from './h3/v1/SetPolicyRequest.js';
import type { SnapshotSessionRequest as _h3_v1_SnapshotSessionRequest, SnapshotSessionRequest__Output as _h3_v1_SnapshotSessionRequest__Output } from './h3/v1/SnapshotSessionRequest.js';
import type { SnapshotSessionResponse as _h3_v1_SnapshotSessionResponse, SnapshotSessionResponse__Output as _h3_v1_SnapshotSessionResponse__Output } from './h3/v1/SnapshotSessionResponse.js';
import type { Stats as _h3_v1_Stats, Stats__Output as _h3_v1_Stats__Output } from './h3/v1/Stats.js';
import type { Throughput as _h3_v1_Throughput, Throughput__Output as _h3_v1_Throughput__Output } from './h3/v1/Throughput.js';
import type { TierResidency as _h3_v1_TierResidency, TierResidency__Output as _h3_v1_TierResidency__Output } from './h3/v1/TierResidency.js';
import type { TierStats as _h3_v1_TierStats, TierStats__Output as _h3_v1_TierStats__Output } from './h3/v1/TierStats.js';
import type { TokenDelta as _h3_v1_TokenDelta, TokenDelta__Output as _h3_v1_TokenDelta__Output } from './h3/v1/TokenDelta.js';

type SubtypeConstructor<Constructor extends new (...args: any) => any, Subtype> = {
  new(...args: ConstructorParameters<Constructor>): Subtype;
};

export interface ProtoGrpcType {
  h3: {
    v1: {
      AppendContextRequest: MessageTypeDefinition<_h3_v1_AppendContextRequest, _h3_v1_AppendContextRequest__Output>
      AppendContextResponse: MessageTypeDefinition<_h3_v1_AppendContextResponse, _h3_v1_AppendContextResponse__Output>
      AppendProgress: MessageTypeDefinition<_h3_v1_AppendProgress, _h3_v1_AppendProgress__Output>
      AppendSummary: MessageTypeDefinition<_h3_v1_AppendSummary, _h3_v1_AppendSummary__Output>
      CloseSessionRequest: MessageTypeDefinition<_h3_v1_CloseSessionRequest, _h3_v1_CloseSessionRequest__Output>
      CloseSessionResponse: MessageTypeDefinition<_h3_v1_CloseSessionResponse, _h3_v1_CloseSessionResponse__Output>
      CreateSessionRequest: MessageTypeDefinition<_h3_v1_CreateSessionRequest, _h3_v1_CreateSessionRequest__Output>
      DrainRequest: MessageTypeDefinition<_h3_v1_DrainRequest, _h3_v1_DrainRequest__Output>
      DrainResponse: MessageTypeDefinition<_h3_v1_DrainResponse, _h3_v1_DrainResponse__Output>
      EvictSessionRequest: MessageTypeDefinition<_h3_v1_EvictSessionRequest, _h3_v1_EvictSessionRequest__Output>
      EvictSessionResponse: MessageTypeDefinition<_h3_v1_EvictSessionResponse, _h3_v1_EvictSessionResponse__Output>
      FinishReason: EnumTypeDefinition
      ForkSessionRequest: MessageTypeDefinition<_h3_v1_ForkSessionRequest, _h3_v1_ForkSessionRequest__Output>
      GenerateRequest: MessageTypeDefinition<_h3_v1_GenerateRequest, _h3_v1_GenerateRequest__Output>
      GenerateResponse: MessageTypeDefinition<_h3_v1_GenerateResponse, _h3_v1_GenerateResponse__Output>
      GenerateSummary: MessageTypeDefinition<_h3_v1_GenerateSummary, _h3_v1_GenerateSummary__Output>
      GetConfigRequest: MessageTypeDefinition<_h3_v1_GetConfigRequest, _h3_v1_GetConfigRequest__Output>
      GetConfigResponse: MessageTypeDefinition<_h3_v1_GetConfigResponse, _h3_v1_GetConfigResponse__Output>
      GetSessionRequest: MessageTypeDefinition<_h3_v1_GetSessionRequest, _h3_v1_GetSessionRequest__Output>
      GetStatsRequest: MessageTypeDefinition<_h3_v1_GetStatsRequest, _h3_v1_GetStatsRequest__Output>
      GraphStats: MessageTypeDefinition<_h3_v1_GraphStats, _h3_v1_GraphStats__Output>
      H3: SubtypeConstructor<typeof grpc.Client, _h3_v1_H3Client> & { service: _h3_v1_H3Definition }
      H3Admin: SubtypeConstructor<typeof grpc.Client, _h3_v1_H3AdminClient> & { service: _h3_v1_H3AdminDefinition }
      ListSessionsRequest: MessageTypeDefinition<_h3_v1_ListSessionsRequest, _h3_v1_ListSessionsRequest__Output>
      ListSessionsResponse: MessageTypeDefinition<_h3_v1_ListSessionsResponse, _h3_v1_ListSessionsResponse__Output>
      PinSessionRequest: MessageTypeDefinition<_h3_v1_PinSessionRequest, _h3_v1_PinSessionRequest__Output>
      ReleaseSessionRequest: MessageTypeDefinition<_h3_v1_ReleaseSessionRequest, _h3_v1_ReleaseSessionRequest__Output>
      ReleaseSessionResponse: MessageTypeDefinition<_h3_v1_ReleaseSessionResponse, _h3_v1_ReleaseSessionResponse__Output>
      ResumeRequest: MessageTypeDefinition<_h3_v1_ResumeRequest, _h3_v1_ResumeRequest__Output>
      ResumeResponse: MessageTypeDefinition<_h3_v1_ResumeResponse, _h3_v1_ResumeResponse__Output>
      SamplingParams: MessageTypeDefinition<_h3_v1_SamplingParams, _h3_v1_SamplingParams__Output>
      Session: MessageTypeDefinition<_h3_v1_Session, _h3_v1_Session__Output>
      SessionStats: MessageTypeDefinition<_h3_v1_SessionStats, _h3_v1_SessionStats__Output>
      SetPolicyRequest: MessageTypeDefinition<_h3_v1_SetPolicyRequest, _h3_v1_SetPolicyRequest__Output>
      SnapshotSessionRequest: MessageTypeDefinition<_h3_v1_SnapshotSessionRequest, _h3_v1_SnapshotSessionRequest__Output>
      SnapshotSessionResponse: MessageTypeDefinition<_h3_v1_SnapshotSessionResponse, _h3_v1_SnapshotSessionResponse__Output>
      Stats: MessageTypeDefinition<_h3_v1_Stats, _h3_v1_Stats__Output>
      Throughput: MessageTypeDefinition<_h3_v1_Throughput, _h3_v1_Throughput__Output>
      Tier: EnumTypeDefinition
      TierResidency: MessageTypeDefinition<_h3_v1_TierResidency, _h3_v1_TierResidency__Output>
      TierStats: MessageTypeDefinition<_h3_v1_TierStats, _h3_v1_TierStats__Output>
      TokenDelta: MessageTypeDefinition<_h3_v1_TokenDelta, _h3_v1_TokenDelta__Output>
    }
  }
}

