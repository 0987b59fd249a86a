// One channel to the daemon and the metadata every call carries.

import { type ChannelCredentials, type ChannelOptions, type Client, credentials, Metadata } from "@grpc/grpc-js";

/** Where the daemon is and how to reach it. */
export interface ConnectionOptions {
  /**
   * `unix:///run/h3d/h3d.sock` (or a bare absolute path: `/run/h3d/h3d.sock`) for the Unix socket,
   * `127.0.0.1:50051` for TCP.
   */
  address: string;
  /** Sent as `authorization: Bearer <token>` with every call (the daemon's `auth_token_file`). */
  token?: string;
  /** Default: insecure (a Unix socket, or TCP on localhost); `credentials.createSsl(ca)` for TLS. */
  credentials?: ChannelCredentials;
  /** grpc-js channel options, e.g. `{ "grpc.max_receive_message_length": ... }`. */
  channelOptions?: ChannelOptions;
}

type StubClass<S extends Client> = new (
  address: string,
  credentials: ChannelCredentials,
  options?: ChannelOptions,
) => S;

/** A stub of `Service` over a new channel, and the metadata to send with each of its calls. */
export function connect<S extends Client>(Service: StubClass<S>, options: ConnectionOptions): [S, Metadata] {
  const address = options.address.startsWith("/") ? `unix:${options.address}` : options.address;
  const stub = new Service(address, options.credentials ?? credentials.createInsecure(), options.channelOptions);
  const metadata = new Metadata();
  if (options.token !== undefined) {
    metadata.set("authorization", `Bearer ${options.token}`);
  }
  return [stub, metadata];
}
