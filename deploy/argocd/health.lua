-- Argo CD health of memops' kinds (memops.dev MemoryPolicy and RetirementRequest), read from
-- the kstatus conditions memops writes (Ready, Reconciling, Stalled; memops/decisions/conditions.py) and
-- from status.observedGeneration against metadata.generation.
local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end

local hs = {}
local generation = 0
if obj.metadata ~= nil and obj.metadata.generation ~= nil then
  generation = obj.metadata.generation
end
local status = obj.status
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for memops to report a status"
  return hs
end

-- A RetirementRequest is one-shot: memops refuses a spec change after its drain started.
local rejected = condition(status, "SpecChangeRejected")
if rejected ~= nil and rejected.status == "True" and (rejected.observedGeneration or 0) >= generation then
  hs.status = "Degraded"
  hs.message = describe(rejected)
  return hs
end

local observed = status.observedGeneration or 0
local ready = condition(status, "Ready")
if observed < generation or ready == nil or (ready.observedGeneration or 0) < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for memops to observe generation " .. tostring(generation)
  return hs
end

local stalled = condition(status, "Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end

local reconciling = condition(status, "Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(reconciling)
  return hs
end

if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

hs.status = "Progressing"
hs.message = describe(ready)
return hs
