// A real `h3d serve` for the tests: the embedded model, a temporary data dir and Unix socket, TCP on
// a free port of 127.0.0.1, and bearer tokens. Started once per test file, stopped with SIGTERM.
//
//   H3D_BIN    the daemon (default: the repo's .venv/bin/h3d, made by `make setup`)
//   H3D_MODEL  the model folder (default: the repo's .cache/models/smollm2-135m-instruct, as the
//              Python tests convert it, else data/models/smollm2-135m-instruct, as `make run` does)

import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const REPO = fileURLToPath(new URL("../../../../", import.meta.url)); // from clients/node/dist/test
const MODELS = [".cache/models/smollm2-135m-instruct", "data/models/smollm2-135m-instruct"];
const START_TIMEOUT_MS = 120_000;
const STOP_TIMEOUT_MS = 60_000;

export const CLIENT_TOKEN = "node-client-token";
export const ADMIN_TOKEN = "node-admin-token";

export interface Daemon {
  /** The Unix socket's path. */
  socket: string;
  /** HOST:PORT of its TCP listener. */
  address: string;
  /** Its output so far (JSON log lines). */
  log: string[];
  /** SIGTERM, wait for the exit, remove the data dir; the exit code. */
  stop(): Promise<number | null>;
}

export function daemonBinary(): string {
  const bin = process.env["H3D_BIN"] ?? join(REPO, ".venv/bin/h3d");
  if (!existsSync(bin)) {
    throw new Error(`no h3d at ${bin}: run \`make setup\` at the repo's root, or set H3D_BIN`);
  }
  return bin;
}

export function modelDir(): string {
  const given = process.env["H3D_MODEL"];
  const candidates = given !== undefined ? [given] : MODELS.map((path) => join(REPO, path));
  const found = candidates.find((dir) => existsSync(join(dir, "config.json")));
  if (found === undefined) {
    throw new Error(
      `no model folder (config.json) at ${candidates.join(" or ")}: set H3D_MODEL, or convert the ` +
        `embedded model with \`.venv/bin/h3d convert-gguf --embedded ${MODELS[0]}\` at the repo's root`,
    );
  }
  return found;
}

export async function startDaemon(): Promise<Daemon> {
  const [bin, model] = [daemonBinary(), modelDir()];
  const dir = mkdtempSync(join(tmpdir(), "h3d-node-"));
  const socket = join(dir, "h3d.sock");
  writeFileSync(join(dir, "tokens"), `${CLIENT_TOKEN}\n`);
  writeFileSync(join(dir, "admin-tokens"), `${ADMIN_TOKEN}\n`);
  const args = [
    "serve", "--model", model, "--data-dir", dir, "--socket", socket, "--listen", "127.0.0.1:0",
    "--auth-token-file", join(dir, "tokens"), "--admin-token-file", join(dir, "admin-tokens"),
    "--hbm-mb", "64", "--ddr-mb", "256",
  ];
  const child = spawn(bin, args, { stdio: ["ignore", "pipe", "pipe"] });
  const exited = once(child, "exit") as Promise<[number | null, NodeJS.Signals | null]>;
  const log: string[] = [];
  createInterface({ input: child.stderr }).on("line", (line) => log.push(line));
  try {
    const address = await listening(child, log);
    return { socket, address, log, stop: () => stop(child, exited, dir) };
  } catch (error) {
    child.kill("SIGKILL");
    rmSync(dir, { recursive: true, force: true });
    throw error;
  }
}

/** The TCP address from the daemon's `listening` log event, once it has logged it. */
function listening(child: ChildProcess, log: string[]): Promise<string> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      reject(new Error(`h3d serve did not start in ${START_TIMEOUT_MS / 1000} s:\n${tail(log)}`));
    }, START_TIMEOUT_MS);
    createInterface({ input: child.stdout! }).on("line", (line) => {
      log.push(line);
      const event = parse(line);
      if (event?.["event"] === "listening") {
        clearTimeout(timer);
        resolve(String(event["address"]));
      }
    });
    child.once("error", reject);
    child.once("exit", (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`h3d serve exited (${code ?? signal}) before listening:\n${tail(log)}`));
    });
  });
}

async function stop(
  child: ChildProcess,
  exited: Promise<[number | null, unknown]>,
  dir: string,
): Promise<number | null> {
  child.kill("SIGTERM");
  const timer = setTimeout(() => child.kill("SIGKILL"), STOP_TIMEOUT_MS);
  const [code] = await exited;
  clearTimeout(timer);
  rmSync(dir, { recursive: true, force: true });
  return code;
}

function parse(line: string): Record<string, unknown> | undefined {
  try {
    const value: unknown = JSON.parse(line);
    return typeof value === "object" && value !== null ? (value as Record<string, unknown>) : undefined;
  } catch {
    return undefined;
  }
}

function tail(log: string[]): string {
  return log.slice(-30).join("\n");
}
