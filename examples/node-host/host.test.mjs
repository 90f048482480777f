// A host's test suite in Node (`node --test`), against the bridge on fake-codex and
// against the replay server with a cassette: the same host code, `runHost`, drives both.
// Commands are found on PATH (or REST_BRIDGE, FAKE_CODEX, REST_BRIDGE_SCENARIOS); the
// cassette is cassettes/host.yaml beside host.scenario.yaml, recorded by
// `rest-bridge-scenarios record-cassettes host.scenario.yaml` (README.md says how).
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, test } from "node:test";
import { fileURLToPath } from "node:url";

import { call, killAll, openEvents, start, stop } from "./host.mjs";

const here = fileURLToPath(new URL(".", import.meta.url));
const scenario = join(here, "host.scenario.yaml");
const cassette = join(here, "cassettes", "host.yaml");
const restBridge = process.env.REST_BRIDGE ?? "rest-bridge";
const fakeCodex = process.env.FAKE_CODEX ?? "fake-codex";
const replayCommand = process.env.REST_BRIDGE_SCENARIOS ?? "rest-bridge-scenarios";

// A host bug (an approval never answered) must fail the test, not hang the suite: each
// test has a deadline, and whatever it started is killed after it, passed or not.
const deadline = { timeout: 60_000 };
afterEach(killAll);

/** The host under test: a turn whose command it approves, read over SSE. */
async function runHost(base) {
  const created = await call(base, "POST", "/v1/sessions", {});
  assert.equal(created.status, 201);
  const session = created.body.sessionId;
  const path = `/v1/sessions/${session}`;
  const events = await openEvents(base, `${path}/events/stream`);
  const thread = (await call(base, "POST", `${path}/call/thread/start`, { params: {} }))
    .body.result.thread.id;
  const turn = await call(base, "POST", `${path}/call/turn/start`, {
    params: { threadId: thread, input: [{ type: "text", text: "say hello" }] },
  });
  assert.equal(turn.status, 200);

  const seen = [];
  let request;
  for (let frame; (frame = await events.next()) !== null;) {
    seen.push(frame);
    if (frame.event === "request") {
      request = frame.data;
      const answer = await call(base, "POST", `${path}/requests/${request.requestKey}/result`,
        { result: { decision: "accept" } });
      assert.deepEqual(answer.body, { status: "sent", requestKey: request.requestKey });
    }
    if (frame.data.method === "turn/completed") break;
  }
  events.close();
  assert.equal(request.method, "item/commandExecution/requestApproval");
  assert.deepEqual(seen.map((frame) => Number(frame.id)), seen.map((frame) => frame.data.seq));
  const texts = seen.filter((f) => f.data.method === "item/completed").map((f) => f.data.params.item.text);
  assert.ok(texts.includes("It printed hello."), texts.join(" | "));

  // Resume after the request's id: the frames after it, the same ones.
  const resumed = await openEvents(base, `${path}/events/stream`, { "Last-Event-ID": String(request.seq) });
  const again = [];
  for (let frame; (frame = await resumed.next()) !== null;) {
    again.push(frame);
    if (frame.data.method === "turn/completed") break;
  }
  resumed.close();
  const after = seen.filter((frame) => frame.data.seq > request.seq);
  assert.deepEqual(again.map((f) => f.data.seq), after.map((f) => f.data.seq));

  const deleted = await call(base, "DELETE", path);
  assert.deepEqual(deleted, { status: 200, body: { status: "deleted", sessionId: session } });
}

test("the host against rest-bridge serve on fake-codex playing a scenario file", deadline, async () => {
  const reports = mkdtempSync(join(tmpdir(), "node-host-"));
  try {
    const bridge = await start(restBridge, [
      "serve", "--port", "0", "--app-server", `${fakeCodex} app-server --script ${scenario}`,
    ], { env: { ...process.env, FAKE_CODEX_REPORT: reports } });
    await runHost(bridge.url);
    const { code, signal } = await stop(bridge);
    assert.deepEqual({ code, signal }, { code: 0, signal: null });
    // The fake's end-of-run report: every server request answered, every turn played.
    const files = readdirSync(reports).filter((name) => name.endsWith(".json"));
    assert.equal(files.length, 1);
    const report = JSON.parse(readFileSync(join(reports, files[0]), "utf8"));
    assert.deepEqual(report.serverRequests.map((r) => [r.state, r.reply]), [["answered", "result"]]);
    assert.deepEqual(report.turns, [1]);
    assert.notEqual(report.exit, null);
  } finally {
    rmSync(reports, { recursive: true, force: true });
  }
});

test("the host against the replay server with the scenario's cassette", deadline, async () => {
  assert.ok(existsSync(cassette), `no ${cassette}: record it with ` +
    `${replayCommand} record-cassettes ${scenario}`);
  const replay = await start(replayCommand, ["replay", cassette, "--port", "0"]);
  await runHost(replay.url);
  const asked = await call(replay.url, "GET", "/__replay/report");
  assert.equal(asked.body.passed, true, JSON.stringify(asked.body));
  // Something the recording never saw: the error payload, and the replay fails.
  const stray = await call(replay.url, "GET", "/v1/sessions/none");
  assert.equal(stray.status, 404);
  assert.equal(stray.body.error, "not_recorded");
  const { code, stdout } = await stop(replay);
  assert.equal(code, 1);
  const report = JSON.parse(stdout.slice(stdout.indexOf("\n{") + 1));
  assert.equal(report.passed, false);
  assert.deepEqual(report.unused, []);
  assert.deepEqual(report.unmatched.map((u) => `${u.method} ${u.path}`), ["GET /v1/sessions/none"]);
});
