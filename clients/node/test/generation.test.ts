// Generation over scripted streams, without a daemon: deltas, the summary, and how `done` settles.

import assert from "node:assert/strict";
import { test } from "node:test";

import { CancelledError, Generation, H3Error, NotFoundError, Status } from "../src/index.js";
import type { GenerateResponse__Output as GenerateResponse } from "../src/generated/h3/v1/GenerateResponse.js";
import type { GenerateSummary } from "../src/types.js";

const SUMMARY: GenerateSummary = {
  finishReason: "FINISH_REASON_LENGTH",
  promptTokens: 5,
  completionTokens: 3,
  ttftS: 0.1,
  tokensPerS: 20,
  residency: null,
  tierStats: null,
};

function delta(text: string, ...tokenIds: number[]): GenerateResponse {
  return { event: "delta", delta: { text, tokenIds } };
}

async function* script(messages: GenerateResponse[], error?: Error): AsyncGenerator<GenerateResponse> {
  yield* messages;
  if (error !== undefined) {
    throw error;
  }
}

test("deltas are yielded in order; done resolves with the summary", async () => {
  const generation = new Generation(script([delta("Hel", 1), delta("lo", 2, 3), { event: "done", done: SUMMARY }]));
  const texts: string[] = [];
  for await (const d of generation) {
    texts.push(d.text);
  }
  assert.deepEqual(texts, ["Hel", "lo"]);
  assert.equal(await generation.done, SUMMARY);
});

test("collect() gathers text, token ids and summary", async () => {
  const generation = new Generation(script([delta("a", 7), delta("b", 8, 9), { event: "done", done: SUMMARY }]));
  const result = await generation.collect();
  assert.deepEqual(result, { text: "ab", tokenIds: [7, 8, 9], summary: SUMMARY });
});

test("a stream error rejects both the loop and done with the same error", async () => {
  const failure = new NotFoundError(Status.NOT_FOUND, "no session");
  const generation = new Generation(script([delta("x", 1)], failure));
  await assert.rejects(generation.collect(), (error) => error === failure);
  await assert.rejects(generation.done, (error) => error === failure);
});

test("leaving the loop early rejects done with CancelledError", async () => {
  const generation = new Generation(script([delta("a", 1), delta("b", 2), { event: "done", done: SUMMARY }]));
  for await (const _ of generation) {
    break;
  }
  await assert.rejects(generation.done, CancelledError);
});

test("a stream without a summary is an error; a Generation is iterated once", async () => {
  const generation = new Generation(script([delta("a", 1)]));
  await assert.rejects(generation.collect(), (error) => error instanceof H3Error && error.code === Status.UNKNOWN);
  await assert.rejects(generation.collect(), /iterated only once/);
});
