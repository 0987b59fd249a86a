// A terminal chat with the embedded SmolLM2 model, through the daemon that `make run` starts.
//
//   make run                                       # at the repo's root, in one shell
//   npm ci && npm run build && npm run chat        # here, in another
//   npm run chat -- "What is a KV cache?"          # one question, then exit
//
// The daemon is found at $H3D_ADDRESS (`unix:///path/h3d.sock` or `HOST:PORT`), else at
// $H3D_SOCKET, else at make run's socket, data/run/h3d.sock; $H3D_TOKEN is sent as the bearer
// token. Ctrl-C during an answer stops it (its AbortSignal cancels the call); Ctrl-C at the prompt,
// or Ctrl-D, ends the chat.
//
// SmolLM2-Instruct was trained on ChatML turns; the daemon takes plain text, so the turns are
// written out here. Its tokenizer reads `<|im_start|>` and `<|im_end|>` as its special tokens.

import { createInterface } from "node:readline";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import { AbortError, FinishReason, H3Client } from "../src/index.js";

const MAKE_RUN_SOCKET = fileURLToPath(new URL("../../../../data/run/h3d.sock", import.meta.url));
const SYSTEM = "You are a helpful assistant."; // the 135M model is easily thrown off by more

const address = process.env["H3D_ADDRESS"] ?? `unix://${process.env["H3D_SOCKET"] ?? MAKE_RUN_SOCKET}`;
const token = process.env["H3D_TOKEN"];
const h3 = new H3Client({ address, ...(token !== undefined && { token }) });

const { sessionId } = await h3.createSession({
  systemPrompt: `<|im_start|>system\n${SYSTEM}<|im_end|>`,
  sampling: { maxTokens: 256 },
});
let answering: AbortController | undefined;

/** Stream the answer to one question; true if it ran to its end. */
async function ask(question: string): Promise<boolean> {
  answering = new AbortController();
  const prompt = `\n<|im_start|>user\n${question}<|im_end|>\n<|im_start|>assistant\n`;
  const generation = h3.generate(sessionId, { prompt, signal: answering.signal });
  try {
    for await (const delta of generation) {
      process.stdout.write(delta.text);
    }
    const summary = await generation.done;
    const ttftMs = Math.round(summary.ttftS * 1000);
    const rate = summary.tokensPerS.toFixed(1);
    console.log(`\n  [${summary.completionTokens} tokens, first after ${ttftMs} ms, ${rate}/s]`);
    if (summary.finishReason !== FinishReason.FINISH_REASON_STOP) {
      await h3.append(sessionId, "<|im_end|>"); // close the turn the model did not close
    }
    return true;
  } catch (error) {
    if (!(error instanceof AbortError)) {
      throw error;
    }
    console.log("\n  [stopped]");
    // The daemon ends the cancelled request a moment later; until then the session is busy.
    while ((await h3.getSession(sessionId)).busy) {
      await sleep(50);
    }
    await h3.append(sessionId, "<|im_end|>");
    return false;
  } finally {
    answering = undefined;
  }
}

async function chat(): Promise<void> {
  const question = process.argv.slice(2).join(" ");
  if (question !== "") {
    await ask(question);
    return;
  }
  const terminal = createInterface({ input: process.stdin, output: process.stdout, prompt: "> " });
  terminal.on("SIGINT", () => (answering !== undefined ? answering.abort() : terminal.close()));
  console.log(`h3d at ${address}, session ${sessionId}. Ctrl-C stops an answer; Ctrl-D ends.`);
  terminal.prompt();
  for await (const line of terminal) { // lines typed (or piped) during an answer wait their turn
    if (line.trim() !== "") {
      await ask(line.trim());
    }
    terminal.prompt();
  }
}

try {
  await chat();
} finally {
  await h3.close(sessionId);
  h3.closeChannel();
}
