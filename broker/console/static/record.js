// One record's inclusion proof, verified in this browser: the record's bytes are leaf `index`
// of the newest checkpoint's tree, that checkpoint signed by the key pinned on the health page
// and consistent with the last checkpoint this browser saw (checkLog, as the health page).
import { b64decode, checkLog, fetchJson, leafHash, pins, verifyInclusion, VerifyError } from "./verify.js";

const element = document.getElementById("proof");

function say(text, state) {
  element.textContent = text;
  element.className = `status-${state}`;
}

async function prove() {
  const origin = element.dataset.origin;
  const index = BigInt(element.dataset.index);
  const key = pins()[origin];
  if (!key) {
    say("not verified: pin this log's key on the Log health page first", "unpinned");
    return;
  }
  try {
    const { checkpoint } = await checkLog(origin, key);
    if (index >= checkpoint.size) {
      say(`not yet covered: the newest checkpoint has ${checkpoint.size} records; reload in a moment`, "unpinned");
      return;
    }
    const record = await fetchJson(`/console/api/record/${index}`);
    const leaf = await leafHash(b64decode(record.line));
    const url = `/v1/log/proof/inclusion?index=${index}&tree_size=${checkpoint.size}&origin=${encodeURIComponent(origin)}`;
    const proof = (await fetchJson(url)).hashes.map(b64decode);
    if (!(await verifyInclusion(leaf, index, checkpoint.size, proof, checkpoint.root))) {
      throw new VerifyError(`record ${index} is not in the tree the checkpoint of size ${checkpoint.size} signs`);
    }
    say(`verified: record ${index} is in the log of ${checkpoint.size} records the pinned key signed`, "ok");
  } catch (error) {
    const why = error instanceof VerifyError ? error.message : `could not be checked (${error.message})`;
    say(`FAILED: ${why}`, "failed");
  }
}

prove();
