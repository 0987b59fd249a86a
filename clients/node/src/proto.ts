// The h3.v1 services, loaded at run time from the one contract, protos/h3/v1/h3.proto (copied into
// dist/proto by `npm run build`). The static types come from src/generated (`npm run generate`).

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { fileURLToPath } from "node:url";

import type { ProtoGrpcType } from "./generated/h3.js";

/**
 * How messages are converted to and from JavaScript objects. These must match the generator's
 * options in scripts/protos.mjs, which decide the generated types: camelCase field names, 64-bit
 * integers as numbers (token counts and byte sizes stay far below 2^53), enums as their names,
 * unset scalars as their defaults, and a oneof's name holding the field that is set.
 */
export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: false,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
};

const PROTO_PATH = fileURLToPath(new URL("../proto/h3/v1/h3.proto", import.meta.url));

export type H3Package = ProtoGrpcType["h3"]["v1"];

let loaded: H3Package | undefined;

/** The h3.v1 package (service constructors and message types), parsed once. */
export function h3Package(): H3Package {
  if (loaded === undefined) {
    const definition = protoLoader.loadSync(PROTO_PATH, LOADER_OPTIONS);
    loaded = (grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType).h3.v1;
  }
  return loaded;
}
