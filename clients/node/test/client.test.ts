// The client against a real daemon (test/daemon.ts): every call goes over gRPC to `h3d serve`
// running the embedded SmolLM2 model on the CPU.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import {
  AbortError,
  DeadlineExceededError,
  FailedPreconditionError,
  FinishReason,
  H3AdminClient,
  H3Client,
  H3Error,
  InvalidArgumentError,
  NotFoundError,
  PermissionDeniedError,
  type Policy,
  Status,
  type TokenDelta,
  UnauthenticatedError,
  UnavailableError,
} from "../src/index.js";
import { ADMIN_TOKEN, CLIENT_TOKEN, type Daemon, startDaemon } from "./daemon.js";

const NO_SUCH = "0123456789abcdef0123456789abcdef";
const LONG = 4000; // tokens: far more than a test lets a stream produce before it stops it

let daemon: Daemon;
let h3: H3Client;

before(async () => {
  daemon = await startDaemon();
  h3 = new H3Client({ address: `unix://${daemon.socket}`, token: CLIENT_TOKEN });
});

after(async () => {
  h3?.closeChannel();
  if (daemon !== undefined) {
    assert.equal(await daemon.stop(), 0, daemon.log.slice(-20).join("\n"));
  }
});

/** Poll `check` until it returns true; fail after `timeoutMs`. */
async function waitFor(check: () => Promise<boolean>, what: string, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    assert.ok(Date.now() < deadline, `timed out waiting for ${what}`);
    await sleep(50);
  }
}

/** A stopped stream's session is idle again once the daemon has ended its request. */
function idle(sessionId: string): Promise<void> {
  return waitFor(async () => !(await h3.getSession(sessionId)).busy, "the session to be idle");
}

test("create, append, generate, stats and close over the Unix socket", async () => {
  const session = await h3.createSession({ systemPrompt: "You answer in one sentence.", sampling: { maxTokens: 8 } });
  assert.match(session.sessionId, /^[0-9a-f]{32}$/);
  assert.equal(session.sampling?.maxTokens, 8);
  const sid = session.sessionId;

  const appended = await h3.append(sid, "h3d keeps each session's KV cache in three tiers: HBM, DDR and SSD.");
  assert.ok(appended.tokensAdded > 0);
  assert.ok(appended.numTokens >= appended.tokensAdded);

  const generation = h3.generate(sid, { prompt: " In short, the three tiers are", maxTokens: 16, ignoreEos: true });
  const deltas: TokenDelta[] = [];
  for await (const delta of generation) {
    deltas.push(delta);
  }
  const summary = await generation.done;
  assert.notEqual(deltas.map((d) => d.text).join("").trim(), "");
  const tokens = deltas.reduce((n, d) => n + d.tokenIds.length, 0);
  assert.equal(tokens, 16);
  assert.equal(summary.completionTokens, tokens);
  assert.equal(summary.finishReason, FinishReason.FINISH_REASON_LENGTH);
  assert.ok(summary.promptTokens > appended.numTokens);
  assert.ok(summary.ttftS > 0);

  const stats = await h3.stats(sid);
  assert.deepEqual(
    stats.sessions.map((s) => [s.sessionId, s.numTokens]),
    [[sid, summary.promptTokens + summary.completionTokens]],
  );
  assert.ok(stats.throughput !== null && stats.throughput.generatedTokensTotal >= 16);

  await h3.close(sid);
  const closed = await h3.getSession(sid);
  assert.equal(closed.closed, true); // closed, not deleted: its next request reopens it
  await h3.close(sid, { purge: true });
  await assert.rejects(h3.getSession(sid), NotFoundError);
});

test("releaseSession: refused without the remote tier, the session kept", async () => {
  const { sessionId: sid } = await h3.createSession();
  await assert.rejects(h3.releaseSession(sid), FailedPreconditionError);
  const kept = await h3.getSession(sid);
  assert.equal(kept.servedBy, "");
  await h3.close(sid, { purge: true });
});

test("forkSession: a prefix of a session, ready to decode", async () => {
  const { sessionId: sid } = await h3.createSession();
  const appended = await h3.append(sid, "A fork shares the first part of a conversation and goes its own way.");
  const fork = await h3.forkSession(sid, { atTokens: 5 });
  assert.notEqual(fork.sessionId, sid);
  assert.equal(fork.numTokens, 5);
  assert.equal(fork.cachedTokens, 4);
  const whole = await h3.forkSession(sid);
  assert.equal(whole.numTokens, appended.numTokens);
  const parent = await h3.getSession(sid, { withTokens: true });
  const child = await h3.getSession(fork.sessionId, { withTokens: true });
  assert.deepEqual(child.tokenIds, parent.tokenIds.slice(0, 5));
  await assert.rejects(h3.forkSession(sid, { atTokens: 100_000 }), InvalidArgumentError);
  for (const id of [sid, fork.sessionId, whole.sessionId]) {
    await h3.close(id, { purge: true });
  }
});

test("TCP, a bare socket path, and collect()", async () => {
  const tcp = new H3Client({ address: daemon.address, token: CLIENT_TOKEN });
  const bare = new H3Client({ address: daemon.socket, token: CLIENT_TOKEN });
  try {
    const { sessionId } = await tcp.createSession();
    const options = { prompt: "The capital of France is", maxTokens: 4, ignoreEos: true };
    const result = await tcp.generate(sessionId, options).collect();
    assert.equal(result.tokenIds.length, 4);
    assert.equal(result.summary.completionTokens, 4);
    const seen = await bare.getSession(sessionId, { withTokens: true });
    assert.equal(seen.numTokens, result.summary.promptTokens + 4);
    assert.deepEqual(seen.tokenIds.slice(-4), result.tokenIds);
    assert.notEqual(seen.text, "");
    await bare.close(sessionId);
  } finally {
    tcp.closeChannel();
    bare.closeChannel();
  }
});

test("aborting a generation mid-stream ends it with AbortError; the session stays usable", async () => {
  const { sessionId } = await h3.createSession();
  await h3.append(sessionId, "Count slowly from one to one thousand:");
  const controller = new AbortController();
  const generation = h3.generate(sessionId, { maxTokens: LONG, ignoreEos: true, signal: controller.signal });
  let received = 0;
  await assert.rejects(async () => {
    for await (const _ of generation) {
      if (++received === 3) {
        controller.abort(new Error("enough"));
      }
    }
  }, AbortError);
  await assert.rejects(generation.done, (error: unknown) => {
    assert.ok(error instanceof AbortError && error.code === Status.CANCELLED);
    assert.equal((error.cause as Error).message, "enough");
    return true;
  });
  assert.ok(received >= 3 && received < LONG);

  await idle(sessionId);
  const again = await h3.generate(sessionId, { maxTokens: 4, ignoreEos: true }).collect();
  assert.equal(again.summary.completionTokens, 4);
  await h3.close(sessionId);

  // A signal aborted before the call: rejected without a call.
  await assert.rejects(h3.getSession(sessionId, { signal: AbortSignal.abort() }), AbortError);
});

test("a deadline ends a long generation with DeadlineExceededError", async () => {
  const { sessionId } = await h3.createSession();
  const options = { prompt: "Once upon a time", maxTokens: LONG, ignoreEos: true, deadlineMs: 500 };
  const generation = h3.generate(sessionId, options);
  await assert.rejects(generation.collect(), DeadlineExceededError);
  await idle(sessionId);
  await h3.close(sessionId);
});

test("an unknown session id is NotFoundError, from unary calls and streams", async () => {
  const calls: Array<[string, () => Promise<unknown>]> = [
    ["getSession", () => h3.getSession(NO_SUCH)],
    ["append", () => h3.append(NO_SUCH, "x")],
    ["generate", () => h3.generate(NO_SUCH, { maxTokens: 2 }).collect()],
    ["stats", () => h3.stats(NO_SUCH)],
    ["close", () => h3.close(NO_SUCH)],
  ];
  for (const [name, call] of calls) {
    await assert.rejects(call, (error: unknown) => {
      assert.ok(error instanceof NotFoundError, `${name}: ${String(error)}`);
      assert.ok(error instanceof H3Error && error.code === Status.NOT_FOUND);
      assert.match(error.details, /no session/);
      return true;
    });
  }
});

test("input the daemon rejects is InvalidArgumentError", async () => {
  await assert.rejects(h3.createSession({ policy: "lru" as Policy }), (error: unknown) => {
    assert.ok(error instanceof InvalidArgumentError && error.code === Status.INVALID_ARGUMENT);
    assert.match(error.details, /policy/);
    return true;
  });
  const { sessionId } = await h3.createSession({ systemPrompt: "Hello." });
  await assert.rejects(h3.generate(sessionId, { maxTokens: 0 }).collect(), (error: unknown) => {
    assert.ok(error instanceof InvalidArgumentError);
    assert.match(error.details, /max_tokens/);
    return true;
  });
  await h3.close(sessionId);
});

test("a missing or unknown token is UnauthenticatedError", async () => {
  for (const token of [undefined, "not-a-token"]) {
    const stranger = new H3Client({ address: daemon.socket, ...(token && { token }) });
    try {
      await assert.rejects(stranger.createSession(), UnauthenticatedError);
    } finally {
      stranger.closeChannel();
    }
  }
});

test("H3Admin needs the admin token; a client token is PermissionDeniedError", async () => {
  const admin = new H3AdminClient({ address: daemon.socket, token: ADMIN_TOKEN });
  const notAdmin = new H3AdminClient({ address: daemon.socket, token: CLIENT_TOKEN });
  try {
    const config = await admin.getConfig();
    assert.equal(config["socket"], daemon.socket);
    await assert.rejects(notAdmin.getConfig(), PermissionDeniedError);

    const { sessionId } = await h3.createSession({ policy: "fixed" });
    assert.equal((await admin.setPolicy(sessionId, "exact")).policy, "exact");
    assert.equal((await h3.getSession(sessionId)).policy, "exact");
    await h3.close(sessionId);
  } finally {
    admin.closeChannel();
    notAdmin.closeChannel();
  }
});

test("sessions() pages through the caller's sessions", async () => {
  const created: string[] = [];
  for (let i = 0; i < 3; i++) {
    created.push((await h3.createSession()).sessionId);
  }
  const page = await h3.listSessions({ pageSize: 2 });
  assert.equal(page.sessions.length, 2);
  assert.notEqual(page.nextPageToken, "");
  const all: string[] = [];
  for await (const session of h3.sessions({ pageSize: 2 })) {
    all.push(session.sessionId);
  }
  assert.equal(all.length, page.total);
  assert.deepEqual(all.slice(-3), created);
  await Promise.all(created.map((sid) => h3.close(sid)));
});

test("a chat session: a generation's prompt is the user's message, its answer the assistant's", async () => {
  const session = await h3.createSession({ chat: true });
  assert.equal(session.chat, true);
  assert.equal(session.numMessages, 0);
  const sid = session.sessionId;

  const prompt = "What is the capital of France?";
  const result = await h3.generate(sid, { prompt, maxTokens: 8 }).collect();
  assert.ok(result.tokenIds.length > 0 && result.tokenIds.length <= 8);
  assert.equal(result.summary.completionTokens, result.tokenIds.length);

  const seen = await h3.getSession(sid, { withTokens: true });
  assert.equal(seen.chat, true);
  assert.equal(seen.numMessages, 2); // the user's and the assistant's
  assert.ok(seen.text.includes(prompt), seen.text);
  assert.deepEqual(seen.tokenIds.slice(-result.tokenIds.length), result.tokenIds);
  await h3.close(sid);

  const plain = await h3.createSession();
  assert.equal(plain.chat, false);
  assert.equal(plain.numMessages, 0);
  await h3.close(plain.sessionId);
});

test("a chat session's appends are messages of a role: user by default, assistant, system", async () => {
  const session = await h3.createSession({ chat: true, systemPrompt: "You answer in one word." });
  assert.equal(session.numMessages, 1); // the system message
  const sid = session.sessionId;

  const user = await h3.append(sid, "Name a colour.");
  assert.ok(user.tokensAdded > 0);
  const assistant = await h3.append(sid, "Blue.", { role: "assistant" });
  assert.ok(assistant.tokensAdded > 0);
  assert.equal(assistant.numTokens, user.numTokens + assistant.tokensAdded);
  await h3.append(sid, "Answer in English.", { role: "system" });
  const seen = await h3.getSession(sid, { withTokens: true });
  assert.equal(seen.numMessages, 4);
  assert.ok(seen.numTokens > assistant.numTokens);
  // The template names each message's role before it (its special tokens are left out of `text`).
  const messages = [
    ["system", "You answer in one word."],
    ["user", "Name a colour."],
    ["assistant", "Blue."],
    ["system", "Answer in English."],
  ];
  for (const [role, content] of messages) {
    assert.ok(seen.text.includes(`${role}\n${content}`), `${role}: ${content} in ${JSON.stringify(seen.text)}`);
  }

  const answer = await h3.generate(sid, { prompt: "Another one.", maxTokens: 4 }).collect();
  assert.ok(answer.tokenIds.length > 0);
  assert.equal((await h3.getSession(sid)).numMessages, 6);

  // Neither an unknown role nor token ids make a message.
  await assert.rejects(h3.append(sid, "Hi.", { role: "narrator" as "user" }), (error: unknown) => {
    assert.ok(error instanceof InvalidArgumentError && error.code === Status.INVALID_ARGUMENT);
    assert.match(error.details, /role/);
    return true;
  });
  await assert.rejects(h3.append(sid, answer.tokenIds), InvalidArgumentError);
  assert.equal((await h3.getSession(sid)).numMessages, 6);
  await h3.close(sid);
});

test("a role on a plain session's append is InvalidArgumentError", async () => {
  const { sessionId } = await h3.createSession({ systemPrompt: "Hello." });
  const before = await h3.getSession(sessionId);
  for (const role of ["user", "assistant"] as const) {
    await assert.rejects(h3.append(sessionId, "Hi there.", { role }), (error: unknown) => {
      assert.ok(error instanceof InvalidArgumentError && error.code === Status.INVALID_ARGUMENT, String(error));
      assert.match(error.details, /role/);
      return true;
    });
  }
  const after = await h3.getSession(sessionId);
  assert.equal(after.numTokens, before.numTokens);
  assert.equal(after.numMessages, 0);
  await h3.close(sessionId);
});

// Last: while the daemon drains, it refuses every other test's requests.
test("drain refuses new requests until resume", async () => {
  const admin = new H3AdminClient({ address: daemon.socket, token: ADMIN_TOKEN });
  const notAdmin = new H3AdminClient({ address: daemon.socket, token: CLIENT_TOKEN });
  try {
    await assert.rejects(notAdmin.resume(), PermissionDeniedError);
    assert.deepEqual(await admin.resume(), { wasDraining: false }); // serving: nothing to undo

    const { sessionId } = await h3.createSession();
    const drained = await admin.drain({ timeoutS: 5 });
    assert.equal(drained.requestsCancelled, 0);
    assert.equal((await h3.stats()).draining, true);
    await assert.rejects(h3.createSession(), (error: unknown) => {
      assert.ok(error instanceof UnavailableError && error.code === Status.UNAVAILABLE, String(error));
      assert.match(error.details, /draining/);
      return true;
    });
    await assert.rejects(h3.append(sessionId, "x"), UnavailableError);

    assert.deepEqual(await admin.resume(), { wasDraining: true });
    assert.equal((await h3.stats()).draining, false);
    assert.ok((await h3.append(sessionId, "Back again.")).tokensAdded > 0);
    const again = await h3.generate(sessionId, { maxTokens: 2, ignoreEos: true }).collect();
    assert.equal(again.summary.completionTokens, 2);
    assert.deepEqual(await admin.resume(), { wasDraining: false });
    await h3.close(sessionId);
  } finally {
    // Whatever failed above, leave the daemon serving.
    await admin.resume().catch(() => undefined);
    admin.closeChannel();
    notAdmin.closeChannel();
  }
});
